"""The OpenAI-compatible HTTP API over a cism.Engine (an ASGI app, Starlette).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
POST /tokenize, POST /detokenize, GET /health, GET /metrics (Prometheus),
GET / (the chat page). Errors use OpenAI's schema; a client that goes away
cancels its requests, and their blocks go back to the pool at the next step.
"""
import asyncio
import hmac
import json
import logging
import os
import secrets
import socket
import time
import traceback
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from cism.engine import EngineClosed, QueueFull
from cism.server import protocol as P
from cism.server.metrics import Metrics
from cism.server.textstream import ChoiceText

log = logging.getLogger("cism.server")

DEFAULT_MAX_BODY = 4 << 20


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Server:
    """The state behind the routes: the engine, its tokenizer, limits, metrics."""

    def __init__(self, engine, model_name=None, api_key=None, max_body_bytes=DEFAULT_MAX_BODY,
                 retry_after=1):
        self.engine = engine
        self.model = engine.model
        self.tok = self.model.tokenizer
        self.vocab = self.model.config.vocab
        self.context = self.model.config.context
        pool = engine.pool
        self.room = min(self.context, pool.num_blocks * 16) if pool is not None else self.context
        self.model_name = model_name or "cism"
        self.api_key = api_key
        self.max_body = max_body_bytes
        self.retry_after = retry_after
        self.created = int(time.time())
        self.metrics = Metrics(engine)
        # names this process in every response (replicas behind a proxy tell apart)
        self.instance = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"

    # ---- request plumbing ----

    def check_auth(self, request):
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        # constant time: no early exit on the first differing byte
        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"),
                                   self.api_key.encode("utf-8", "surrogateescape")):
            raise P.APIError(401, "Incorrect API key provided (send 'Authorization: Bearer <key>')",
                             "invalid_request_error", None, "invalid_api_key")

    async def read_json(self, request):
        length = request.headers.get("content-length")
        if length is not None:
            try:
                if int(length) > self.max_body:
                    raise self.too_large()
            except ValueError:
                raise P.bad("the Content-Length header is not a number") from None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise self.too_large()
            chunks.append(chunk)
        data = b"".join(chunks)
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise P.bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise P.bad("the request body must be a JSON object", None, "invalid_type")
        return body

    def too_large(self):
        return P.APIError(413, f"the request body exceeds {self.max_body} bytes",
                          "invalid_request_error", None, "request_too_large")

    def check_model(self, body):
        name = body.get("model")
        if name is None:
            return
        if not isinstance(name, str):
            raise P.bad("'model' must be a string", "model", "invalid_type")
        if name != self.model_name:
            raise P.bad(f"the model '{name}' does not exist: this server serves '{self.model_name}'",
                        "model", "model_not_found")

    def need_tokenizer(self):
        if self.tok is None:
            raise P.bad("this model has no tokenizer: text routes need one", None, "no_tokenizer")

    def budget(self, body, prompt_len, names=("max_completion_tokens", "max_tokens")):
        """max_tokens as asked, or as much as fits; 400 context_length_exceeded past the context."""
        want, name = P.max_tokens(body, names)
        if prompt_len >= self.room:
            raise P.bad(f"the prompt has {prompt_len} tokens; this model's context holds {self.room}",
                        "messages" if "messages" in body else "prompt", "context_length_exceeded")
        if want is None:
            return self.room - prompt_len
        if prompt_len + want > self.room:
            raise P.bad(f"the prompt ({prompt_len} tokens) plus {name} ({want}) exceeds this model's "
                        f"context of {self.room} tokens", name, "context_length_exceeded")
        return want

    def submit(self, ids, n, max_new, knobs, logprobs, top, priority):
        knobs = dict(knobs)
        eos = [] if knobs.pop("ignore_eos") or self.tok is None else list(self.tok.eos_ids)
        try:
            return self.engine.submit_n(ids, n, max_new, eos=eos, logprobs=logprobs, top_logprobs=top,
                                        priority=priority, **knobs)
        except QueueFull as e:
            raise P.APIError(429, str(e), "rate_limit_exceeded", None, "queue_full",
                             {"Retry-After": str(self.retry_after)}) from None
        except EngineClosed:
            raise P.APIError(503, "the server is shutting down", "server_error", None, "shutting_down",
                             {"Retry-After": str(self.retry_after)}) from None
        except ValueError as e:
            code = "context_length_exceeded" if "context" in str(e) or "pool" in str(e) else "invalid_value"
            raise P.bad(str(e), None, code) from None


async def wait_disconnect(request):
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def choice_updates(reqs, texts):
    """(choice, text, tokens, logprobs, top logprobs) as the choices' tokens
    arrive, through each one's ChoiceText; a stop string cancels its
    request. One choice is read directly, several are merged as they come."""
    async def one(i):
        req, ct = reqs[i], texts[i]
        try:
            async for tokens, lps, tops in req.updates():
                text, used = ct.feed(tokens)
                yield i, text, tokens[:used], lps[:used] if lps else None, tops[:used] if tops else None
                if ct.stop_hit is not None:
                    break
        except Exception:
            return    # the request's error: engine_failure() reports it
        finally:
            if ct.stop_hit is not None and not req.done:
                req.cancel()
        tail = ct.close()
        if tail:
            yield i, tail, [], None, None

    if len(reqs) == 1:
        async for update in one(0):
            yield update
        return
    queue = asyncio.Queue()

    async def pump(i):
        try:
            async for update in one(i):
                await queue.put(update)
        finally:
            queue.put_nowait(None)
    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(reqs))]
    try:
        left = len(reqs)
        while left:
            update = await queue.get()
            if update is None:
                left -= 1
            else:
                yield update
    finally:
        for t in tasks:
            t.cancel()


async def run_choices(reqs, texts, on_update):
    """Every update of choice_updates, given to on_update, until all are done."""
    async for update in choice_updates(reqs, texts):
        await on_update(*update)


def engine_failure(reqs):
    for r in reqs:
        if r.error is not None:
            memory = isinstance(r.error, MemoryError)
            return P.APIError(503, f"generation failed: {r.error}", "server_error", None,
                              "out_of_memory" if memory else "engine_error", {"Retry-After": "1"})
    return None


# ----------------------------------------------------------------- routes ---

async def chat_completions(request):
    srv = request.app.state.srv
    srv.check_auth(request)
    body = await srv.read_json(request)
    srv.check_model(body)
    srv.need_tokenizer()
    messages = P.chat_messages(body)
    knobs, n, stops, priority = P.sampling(body, srv.vocab)
    want_lp, top = P.chat_logprobs(body)
    stream, include_usage = P.stream_flags(body)
    if not srv.tok.has_chat_template:
        raise P.bad("this model's tokenizer has no chat template: use /v1/completions", "messages",
                    "no_chat_template")
    try:
        prompt = srv.tok.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:   # a template that refuses these messages (e.g. role order)
        raise P.bad(f"the chat template rejected the messages: {e}", "messages", "invalid_messages") from None
    ids = srv.tok.encode(prompt, add_bos=False)
    max_new = srv.budget(body, len(ids))
    reqs = srv.submit(ids, n, max_new, knobs, want_lp, top, priority)
    srv.metrics.started("chat", len(ids))
    texts = [ChoiceText(srv.tok, stops) for _ in reqs]
    rid, created = P.new_id("chatcmpl"), P.now()
    base = {"id": rid, "created": created, "model": srv.model_name,
            "system_fingerprint": srv.model.compile_key[:16]}
    if stream:
        return sse(request, srv, reqs, chat_events(srv, reqs, texts, base, include_usage, want_lp, len(ids)))
    contents = [[] for _ in reqs]
    lps = [[] for _ in reqs]

    async def collect(i, text, tokens, lp, tp):
        contents[i].append(text)
        if want_lp and lp:
            lps[i] += texts[i].chat_logprobs(tokens, lp, tp)
    await until_done(request, reqs, run_choices(reqs, texts, collect))
    failure = engine_failure(reqs)
    if failure:
        srv.metrics.finished("error", 0)
        raise failure
    choices = []
    for i, (r, ct) in enumerate(zip(reqs, texts)):
        choices.append({"index": i, "message": {"role": "assistant", "content": "".join(contents[i])},
                        "logprobs": {"content": lps[i]} if want_lp else None,
                        "finish_reason": P.finish_reason(r.finish_reason, ct.stop_hit)})
    out_tokens = sum(ct.tokens for ct in texts)
    srv.metrics.finished("ok", out_tokens)
    return JSONResponse(dict(base, object="chat.completion", choices=choices,
                             usage=P.usage(len(ids), out_tokens, reqs[0].cached_tokens)))


def sse_chunk(prefix, choice):
    """An event's JSON: the response's fixed fields (prefix) and one choice."""
    return prefix + json.dumps(choice, ensure_ascii=False, separators=(",", ":")) + "]}"


def chunk_prefix(base, obj):
    return json.dumps(dict(base, object=obj), ensure_ascii=False, separators=(",", ":"))[:-1] + ',"choices":['


def closing_events(srv, reqs, texts, prefix, empty, base, obj, include_usage, prompt_tokens):
    """A stream's last events: each choice's finish reason (its delta or
    text empty), then the usage if asked for; or the engine's error."""
    failure = engine_failure(reqs)
    if failure:
        srv.metrics.finished("error", 0)
        return [json.dumps(failure.body())]
    events = [sse_chunk(prefix, dict({"index": i}, **empty, logprobs=None,
                                     finish_reason=P.finish_reason(r.finish_reason, ct.stop_hit)))
              for i, (r, ct) in enumerate(zip(reqs, texts))]
    out_tokens = sum(ct.tokens for ct in texts)
    srv.metrics.finished("ok", out_tokens)
    if include_usage:
        events.append(json.dumps(dict(base, object=obj, choices=[],
                                      usage=P.usage(prompt_tokens, out_tokens, reqs[0].cached_tokens))))
    return events


async def chat_events(srv, reqs, texts, base, include_usage, want_lp, prompt_len):
    """The SSE events of a streamed chat completion (JSON text)."""
    prefix = chunk_prefix(base, "chat.completion.chunk")
    for i in range(len(reqs)):
        yield sse_chunk(prefix, {"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
    async for i, text, tokens, lp, tp in choice_updates(reqs, texts):
        entry = {"content": texts[i].chat_logprobs(tokens, lp, tp)} if want_lp and lp else None
        if text or entry:
            yield sse_chunk(prefix, {"index": i, "delta": {"content": text}, "logprobs": entry,
                                     "finish_reason": None})
    for event in closing_events(srv, reqs, texts, prefix, {"delta": {}}, base, "chat.completion.chunk",
                                include_usage, prompt_len):
        yield event


async def completions(request):
    srv = request.app.state.srv
    srv.check_auth(request)
    body = await srv.read_json(request)
    srv.check_model(body)
    prompts = P.completion_prompts(body, srv.vocab)
    knobs, n, stops, priority = P.sampling(body, srv.vocab)
    want_lp, top = P.completion_logprobs(body)
    stream, include_usage = P.stream_flags(body)
    echo = P._boolean(body, "echo")
    if body.get("suffix") is not None:
        raise P.bad("'suffix' is not supported by cism", "suffix", "unsupported_parameter")
    srv.need_tokenizer()   # the answer is text
    encoded = [ids if ids is not None else srv.tok.encode(text) for text, ids in prompts]
    budgets = []
    for ids in encoded:
        if not ids:
            raise P.bad("'prompt' encodes to no tokens", "prompt", "invalid_value")
        if body.get("max_tokens") is None:   # OpenAI's default for completions: 16
            budgets.append(min(16, srv.budget(body, len(ids), ("max_tokens",))))
        else:
            budgets.append(srv.budget(body, len(ids), ("max_tokens",)))
    reqs = []
    try:
        for ids, max_new in zip(encoded, budgets):
            reqs += srv.submit(ids, n, max_new, knobs, want_lp, top, priority)
    except P.APIError:
        for r in reqs:
            r.cancel()
        raise
    prompt_tokens = sum(len(ids) for ids in encoded)
    srv.metrics.started("completions", prompt_tokens)
    texts = [ChoiceText(srv.tok, stops) for _ in reqs]
    echoes = [(text if text is not None else srv.tok.decode(ids)) if echo else ""
              for (text, _), ids in zip(prompts, encoded) for _ in range(n)]
    rid, created = P.new_id("cmpl"), P.now()
    base = {"id": rid, "created": created, "model": srv.model_name,
            "system_fingerprint": srv.model.compile_key[:16]}
    if stream:
        return sse(request, srv, reqs, completion_events(srv, reqs, texts, base, include_usage, want_lp,
                                                         prompt_tokens, echoes))
    parts = [[e] for e in echoes]
    lps = [None] * len(reqs)
    offsets = [len(e) for e in echoes]

    async def collect(i, text, tokens, lp, tp):
        parts[i].append(text)
        if want_lp and lp:
            entry, offsets[i] = texts[i].completion_logprobs(tokens, lp, tp, offsets[i])
            if lps[i] is None:
                lps[i] = entry
            else:
                for k in lps[i]:
                    lps[i][k] += entry[k]
    await until_done(request, reqs, run_choices(reqs, texts, collect))
    failure = engine_failure(reqs)
    if failure:
        srv.metrics.finished("error", 0)
        raise failure
    empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    choices = [{"index": i, "text": "".join(parts[i]),
                "logprobs": (lps[i] or empty) if want_lp else None,
                "finish_reason": P.finish_reason(r.finish_reason, ct.stop_hit)}
               for i, (r, ct) in enumerate(zip(reqs, texts))]
    out_tokens = sum(ct.tokens for ct in texts)
    srv.metrics.finished("ok", out_tokens)
    return JSONResponse(dict(base, object="text_completion", choices=choices,
                             usage=P.usage(prompt_tokens, out_tokens, reqs[0].cached_tokens)))


async def completion_events(srv, reqs, texts, base, include_usage, want_lp, prompt_tokens, echoes):
    prefix = chunk_prefix(base, "text_completion")
    offsets = [len(e) for e in echoes]
    for i, e in enumerate(echoes):
        if e:
            yield sse_chunk(prefix, {"index": i, "text": e, "logprobs": None, "finish_reason": None})
    async for i, text, tokens, lp, tp in choice_updates(reqs, texts):
        entry = None
        if want_lp and lp:
            entry, offsets[i] = texts[i].completion_logprobs(tokens, lp, tp, offsets[i])
        if text or entry:
            yield sse_chunk(prefix, {"index": i, "text": text, "logprobs": entry, "finish_reason": None})
    for event in closing_events(srv, reqs, texts, prefix, {"text": ""}, base, "text_completion",
                                include_usage, prompt_tokens):
        yield event


async def until_done(request, reqs, work):
    """Run `work` unless the client disconnects first (then cancel the requests)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            for r in reqs:
                r.cancel()
            task.cancel()
            gone.cancel()
            request.app.state.srv.metrics.finished("disconnected", 0)
            raise ClientGone()
        gone.cancel()
    task.result()


def sse(request, srv, reqs, events):
    """A streamed answer: each event as `data: {json}`, then `data: [DONE]`.
    The client going away closes the generator: its requests are cancelled."""
    async def body():
        finished = False
        try:
            async for event in events:
                yield f"data: {event}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                for r in reqs:
                    r.cancel()
                srv.metrics.finished("disconnected", 0)
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def models(request):
    srv = request.app.state.srv
    srv.check_auth(request)
    card = {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "cism",
            "meta": {"n_ctx": srv.room, "n_vocab": srv.vocab, "precision": srv.model.precision,
                     "family": srv.model.config.model_type}}
    name = request.path_params.get("model")
    if name is not None:
        if name != srv.model_name:
            raise P.APIError(404, f"the model '{name}' does not exist", "invalid_request_error",
                             "model", "model_not_found")
        return JSONResponse(card)
    return JSONResponse({"object": "list", "data": [card]})


async def tokenize(request):
    srv = request.app.state.srv
    srv.check_auth(request)
    body = await srv.read_json(request)
    srv.need_tokenizer()
    content = P._string(body, "content")
    if content is None:
        raise P.bad("'content' (a string) is required", "content", "missing_required_parameter")
    add_special = P._boolean(body, "add_special", False)
    pieces = P._boolean(body, "with_pieces", False)
    ids = srv.tok.encode(content, add_bos=add_special and srv.tok.bos_id is not None)
    if pieces:
        return JSONResponse({"tokens": [{"id": i, "piece": srv.tok.token_bytes(i).decode("utf-8", "replace")}
                                        for i in ids]})
    return JSONResponse({"tokens": ids})


async def detokenize(request):
    srv = request.app.state.srv
    srv.check_auth(request)
    body = await srv.read_json(request)
    srv.need_tokenizer()
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list):
        raise P.bad("'tokens' must be a list of token ids", "tokens", "invalid_type")
    ids = P._ids(tokens, srv.vocab, "tokens") if tokens else []
    return JSONResponse({"content": srv.tok.decode(ids)})


async def health(request):
    srv = request.app.state.srv
    if srv.engine._closed:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request):
    srv = request.app.state.srv
    srv.check_auth(request)
    return PlainTextResponse(srv.metrics.render(), media_type="text/plain; version=0.0.4")


async def chat_page(request):
    page = resources.files("cism.server").joinpath("chat.html").read_text(encoding="utf-8")
    srv = request.app.state.srv
    return HTMLResponse(page.replace("{{MODEL}}", srv.model_name))


# ---------------------------------------------------------------- the app ---

def _wrap(handler):
    """OpenAI-schema errors for everything a handler raises; a client that
    left gets nothing (its connection is gone)."""
    async def endpoint(request):
        srv = request.app.state.srv
        try:
            response = await handler(request)
        except P.APIError as e:
            response = JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except ClientGone:
            response = Response(status_code=499)
        except Exception as e:  # a bug: keep serving, say what happened
            log.error("internal error in %s: %s", request.url.path, traceback.format_exc())
            response = JSONResponse(P.APIError(500, f"internal error: {type(e).__name__}: {e}",
                                               "server_error").body(), status_code=500)
        srv.metrics.http(request.url.path, response.status_code)
        response.headers["X-Cism-Server"] = srv.instance
        return response
    return endpoint


async def _http_error(request, exc):
    srv = request.app.state.srv
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = P.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     "invalid_request_error", None, code)
    srv.metrics.http("other", exc.status_code)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def create_app(engine, *, model_name=None, api_key=None, max_body_bytes=DEFAULT_MAX_BODY, retry_after=1):
    """The ASGI app serving `engine` (a running cism.Engine) under the
    OpenAI API; `api_key` (if set) is required as a Bearer token on every
    route but / and /health."""
    srv = Server(engine, model_name, api_key, max_body_bytes, retry_after)
    routes = [
        Route("/v1/chat/completions", _wrap(chat_completions), methods=["POST"]),
        Route("/v1/completions", _wrap(completions), methods=["POST"]),
        Route("/v1/models", _wrap(models), methods=["GET"]),
        Route("/v1/models/{model:path}", _wrap(models), methods=["GET"]),
        Route("/tokenize", _wrap(tokenize), methods=["POST"]),
        Route("/detokenize", _wrap(detokenize), methods=["POST"]),
        Route("/health", _wrap(health), methods=["GET"]),
        Route("/metrics", _wrap(metrics), methods=["GET"]),
        Route("/", _wrap(chat_page), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.srv = srv
    return app
