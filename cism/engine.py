"""``cism.Engine``: many requests served over one weight stream.

    engine = cism.Engine(model)                       # starts its step thread
    req = engine.submit(tok.encode("Once upon a time"), max_new_tokens=64, seed=1)
    for token in req:                                 # blocking; `async for` works too
        print(tok.decode([token]), end="")
    print(req.finish_reason, req.ttft)
    engine.shutdown()

Requests join and leave at any step. Each step runs one forward over the
decode tokens of every running request and the prompt chunks of new ones
(cism._engine). Every request gets exactly the tokens, and logprobs, that a
solo session with the same prompt and settings gives, whatever else runs
beside it (docs/EXACTNESS.md).
"""
import asyncio
import bisect
import collections
import itertools
import math
import os
import threading
import time
import weakref

from cism._config import is_int, stoll
from cism.sampling import check_knobs, check_sampling, check_seed

MAX_SPEC_K = 16
MAX_TOP_LOGPROBS = 20
DEFAULT_KV_BYTES = 1 << 30
DEFAULT_SNAPSHOT_BYTES = 256 << 20


class QueueFull(RuntimeError):
    """The engine's queue is at max_queue: retry later."""


class EngineClosed(RuntimeError):
    """The engine has been shut down."""


class Request:
    """A submitted request. Iterate it (``for``, or ``async for``) for its
    tokens as they are made; ``result()`` waits for all of them.

    ``finish_reason`` is None while it runs, then "stop" (an eos token),
    "length", "cancelled" or "error" (``error`` holds the exception).
    ``logprobs`` / ``top_logprobs`` (when asked for) run parallel to
    ``tokens``: log p of each token under the model's raw logits, and the
    most likely alternatives as (token, log p). Times are
    ``time.monotonic()`` seconds."""

    def __init__(self, engine, req_id, prompt, params):
        self.engine = engine
        self.id = req_id
        self.prompt = prompt
        self.params = params
        self.tokens = []
        self.logprobs = [] if params["logprobs"] else None
        self.top_logprobs = [] if params["logprobs"] else None
        self.finish_reason = None
        self.error = None
        self.queued_at = time.monotonic()
        self.first_token_at = None
        self.finished_at = None
        self.cached_tokens = 0
        self.preemptions = 0
        self._seq = None
        self._leader = None
        self._cancel = False
        self._cond = threading.Condition()
        self._waiters = []

    # ---- the engine thread's side ----

    def _publish(self, tokens, lps, tops):
        with self._cond:
            if self.first_token_at is None and tokens:
                self.first_token_at = time.monotonic()
            self.tokens.extend(tokens)
            if lps is not None:
                self.logprobs.extend(lps)
                self.top_logprobs.extend(tops)
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        _wake(waiters)

    def _finish(self, reason, error):
        seq = self._seq
        with self._cond:
            self.finish_reason = reason
            self.error = error
            self.finished_at = time.monotonic()
            if seq is not None:
                self.cached_tokens = seq.cached_tokens
                self.preemptions = seq.preemptions
            self._seq = None
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        _wake(waiters)
        self.engine._finished(self)

    # ---- the caller's side ----

    @property
    def done(self):
        return self.finish_reason is not None

    def cancel(self):
        """Stop the request from any thread; it finishes "cancelled" at the
        next step (tokens made so far stay in ``tokens``)."""
        self._cancel = True
        seq = self._seq
        if seq is not None:
            seq.cancel()
        self.engine._wake()

    def wait(self, timeout=None):
        """Wait until the request finishes; returns whether it has."""
        with self._cond:
            return self._cond.wait_for(lambda: self.finish_reason is not None, timeout)

    def result(self, timeout=None):
        """All tokens once finished (raises the request's error, if any, or
        TimeoutError)."""
        if not self.wait(timeout):
            raise TimeoutError(f"request {self.id} still running after {timeout} s")
        if self.error is not None:
            raise self.error
        return list(self.tokens)

    async def result_async(self):
        async for _ in self:
            pass
        return list(self.tokens)

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self.tokens) > i or self.finish_reason is not None)
                batch = self.tokens[i:]
                finished = self.finish_reason is not None
            for t in batch:
                yield t
            i += len(batch)
            if finished and i >= len(self.tokens):
                break
        if self.error is not None:
            raise self.error

    async def __aiter__(self):
        async for tokens, _, _ in self.updates():
            for t in tokens:
                yield t

    async def updates(self):
        """Async batches of what is new: (tokens, logprobs, top_logprobs)
        lists (the last two None without logprobs). Raises the request's
        error, if any, at the end."""
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            with self._cond:
                n = len(self.tokens)
                batch = self.tokens[i:n]
                lps = self.logprobs[i:n] if self.logprobs is not None else None
                tops = self.top_logprobs[i:n] if self.top_logprobs is not None else None
                finished = self.finish_reason is not None
                fut = None
                if not batch and not finished:
                    fut = loop.create_future()
                    self._waiters.append((loop, fut))
            if fut is not None:
                await fut
                continue
            if batch:
                yield batch, lps, tops
            i = n
            if finished:
                break
        if self.error is not None:
            raise self.error

    # ---- timings ----

    @property
    def ttft(self):
        """Seconds from submission to the first token (None before it)."""
        return None if self.first_token_at is None else self.first_token_at - self.queued_at

    @property
    def latency(self):
        return None if self.finished_at is None else self.finished_at - self.queued_at

    def __repr__(self):
        return (f"Request(id={self.id}, prompt_tokens={len(self.prompt)}, tokens={len(self.tokens)}, "
                f"finish_reason={self.finish_reason!r})")


def _wake(waiters):
    for loop, fut in waiters:
        try:
            loop.call_soon_threadsafe(_resolve, fut)
        except RuntimeError:
            pass  # that event loop is closed: nobody waits there any more


def _resolve(fut):
    if not fut.done():
        fut.set_result(None)


class _Histogram:
    """Cumulative counts by upper bound (Prometheus style); thread-safe."""

    def __init__(self, bounds):
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.n = 0
        self.lock = threading.Lock()

    def observe(self, value):
        i = bisect.bisect_left(self.bounds, value)
        with self.lock:
            self.counts[i] += 1
            self.total += value
            self.n += 1

    def snapshot(self):
        with self.lock:
            counts, total, n = list(self.counts), self.total, self.n
        cum, acc = [], 0
        for b, c in zip(self.bounds + [math.inf], counts):
            acc += c
            cum.append((b, acc))
        return {"buckets": cum, "sum": total, "count": n}


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _kv_blocks_default(model, stepper, max_seqs):
    """CISM_PAGED_MAX_BLOCKS when set; else room for max_seqs requests of
    min(context, 2048) tokens within the model's KV budget (1 GiB when it
    has none), and always room for one request of min(context, 4096)."""
    env = os.environ.get("CISM_PAGED_MAX_BLOCKS", "")
    if env.strip():
        # Read as the model's own pool reads it (std::stoll's leading digits),
        # but a value the pool would ignore is an error here, not a silent default.
        try:
            value = stoll(env)
        except ValueError:
            raise ValueError(f"CISM_PAGED_MAX_BLOCKS must be a positive integer, got {env!r}") from None
        if value < 1:
            raise ValueError(f"CISM_PAGED_MAX_BLOCKS must be a positive integer, got {env!r}")
        return value
    per_block = stepper.kv_layers * 16 * stepper.kv_width * stepper.kv_dtype.itemsize * 2
    budget = getattr(model, "kv_budget", None)
    room = (budget - model.kv_in_use) if budget is not None else DEFAULT_KV_BYTES
    context = model.config.context
    want = max_seqs * -(-min(context, 2048) // 16)
    floor = -(-min(context, 4096) // 16)
    blocks = min(want, max(room, 0) // per_block)
    if budget is None:
        blocks = max(blocks, floor)
    if blocks < 1:
        raise ValueError(f"the model's KV budget leaves no room for the engine's pool "
                         f"({room} bytes free, {per_block} per block)")
    return blocks


def _engine_loop(ref, signal, threads):
    """The engine thread: step while there is work, sleep on the signal
    while there is none, end once the engine is shut down or gone."""
    from cism import _kernels
    _kernels.start_threads(threads)   # its OpenMP team, made while memory is plentiful
    while True:
        with signal:
            engine = ref()
            if engine is None:
                return
            work = engine._has_work()
            stop = engine._stop
            del engine
            if not work:
                if stop:
                    return
                signal.wait(0.5)
                continue
        engine = ref()
        if engine is None:
            return
        engine._loop_once()
        del engine


class Engine:
    """Continuous batching over one model, thread-safe.

    ``Engine(model, kv_blocks=None, max_seqs=64, max_step_tokens=256,
    max_queue=None, prefix_caching=True, snapshot_bytes=256 MiB,
    aging_steps=64, start=True)``

    - ``kv_blocks``: blocks of 16 positions in the engine's KV pool
      (attention families; default: $CISM_PAGED_MAX_BLOCKS, else room for
      ``max_seqs`` requests of up to 2048 tokens within the model's KV
      budget, 1 GiB without one).
    - ``max_seqs``: requests admitted at once; ``max_step_tokens``: tokens
      one step's forward runs (decode tokens first, then prompt chunks);
      ``max_queue``: waiting requests before ``submit`` raises QueueFull.
    - ``prefix_caching``: reuse the cached blocks (and, for recurrent
      models, state snapshots, within ``snapshot_bytes``) of earlier
      requests' prompts.
    - ``aging_steps``: a request ranks as its priority minus one for every
      this many steps the engine ran before it arrived: older requests need
      less priority to come first, so none waits forever (docs/SERVING.md).
    - ``start=False``: no thread; drive it with ``step()``.
    """

    def __init__(self, model, *, kv_blocks=None, max_seqs=64, max_step_tokens=256, max_queue=None,
                 prefix_caching=True, snapshot_bytes=DEFAULT_SNAPSHOT_BYTES, aging_steps=64,
                 start=True):
        from cism._engine import EngineCore
        from cism.paging import BlockPool

        stepper_of = getattr(model, "_engine_stepper", None)
        if stepper_of is None:
            raise ValueError(f"{type(model).__name__} cannot be served by cism.Engine")
        for name, value, lo, hi in (("max_seqs", max_seqs, 1, 4096),
                                    ("max_step_tokens", max_step_tokens, 1, 1 << 16),
                                    ("aging_steps", aging_steps, 1, 1 << 40)):
            if not is_int(value) or not lo <= value <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if max_queue is not None and (not is_int(max_queue) or max_queue < 0):
            raise ValueError(f"max_queue must be a nonnegative integer or None, got {max_queue!r}")
        if not is_int(snapshot_bytes) or snapshot_bytes < 0:
            raise ValueError(f"snapshot_bytes must be a nonnegative integer, got {snapshot_bytes!r}")
        self.model = model
        stepper = stepper_of()
        self._pool_bytes = 0
        pool = None
        if stepper.kv_layers:
            if kv_blocks is None:
                kv_blocks = _kv_blocks_default(model, stepper, max_seqs)
            if not is_int(kv_blocks) or not 1 <= kv_blocks <= 1 << 20:
                raise ValueError(f"kv_blocks must be an integer in [1, 2^20], got {kv_blocks!r}")
            nbytes = kv_blocks * stepper.kv_layers * 16 * stepper.kv_width * stepper.kv_dtype.itemsize * 2
            reserve = getattr(model, "_reserve_kv", None)
            if reserve is not None:
                reserve(nbytes, f"the engine's pool ({kv_blocks} blocks)")
                self._pool_bytes = nbytes
            try:
                pool = BlockPool(kv_blocks, stepper.kv_layers, stepper.kv_width, dtype=stepper.kv_dtype,
                                 head_dim=stepper.head_dim)
            except BaseException:
                self._release_pool()
                raise
        self.max_queue = max_queue
        self._core = EngineCore(stepper, pool, bool(prefix_caching), snapshot_bytes, max_seqs,
                                max_step_tokens, aging_steps, model.thread_count)
        self._ids = itertools.count(1)
        self._inbox = collections.deque()
        self._inflight = {}              # id -> Request, until finished
        self._inflight_lock = threading.Lock()
        self._core_lock = threading.Lock()
        self._signal = threading.Condition()
        self._closed = False
        self._stop = False
        self._error = None
        self._stats = self._core.stats()
        self._stats_at = 0.0
        self._submitted = 0
        self._prompt_tokens = 0
        self._outcomes = {"stop": 0, "length": 0, "cancelled": 0, "error": 0}
        self.histograms = {"step_seconds": _Histogram(LATENCY_BUCKETS),
                           "ttft_seconds": _Histogram(LATENCY_BUCKETS)}
        self._thread = None
        if start:
            # one OpenMP team in the process, the step thread's: with a second
            # one (this thread's, from loading the model) libgomp stops
            # spinning between parallel regions and decode slows ~2x
            # (_kernels.release_threads)
            from cism import _kernels
            _kernels.release_threads()
            # the thread holds the engine only while it steps, so an engine
            # nobody references is collected (and its thread ends)
            self._thread = threading.Thread(target=_engine_loop,
                                            args=(weakref.ref(self), self._signal, model.thread_count),
                                            name="cism-engine", daemon=True)
            self._thread.start()

    def _release_pool(self):
        if self._pool_bytes:
            self.model._release_kv(self._pool_bytes)
            self._pool_bytes = 0

    def __del__(self):
        try:
            if self._thread is not None and self._thread.is_alive():
                self.shutdown(drain=False)
            self._release_pool()
        except Exception:
            pass

    # ---- requests ----

    def submit(self, prompt, max_new_tokens=256, *, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
               repetition_penalty=1.0, seed=0, eos=(), stop_token_ids=(), priority=0, spec_k=0,
               logprobs=False, top_logprobs=0, _leader=None):
        """Queue a request and return its Request at once. Arguments are
        checked here (ValueError names the field). ``eos`` and
        ``stop_token_ids`` end it with "stop"; ``spec_k`` 2..16 speculates
        greedily (prompt lookup; same tokens); ``priority``: higher first
        (admission, and who is preempted when blocks run out);
        ``logprobs`` / ``top_logprobs`` (0..20) report log-probabilities."""
        if self._closed:
            raise EngineClosed("the engine has been shut down")
        p, max_new = self._core.check(prompt, max_new_tokens)
        vocab = self._core.vocab
        check_sampling(temperature, top_p, top_k, vocab)
        check_knobs(min_p, repetition_penalty)
        seed = check_seed(seed)
        if not is_int(priority) or not -2**31 <= priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {priority!r}")
        if not is_int(spec_k) or (spec_k != 0 and not 2 <= spec_k <= MAX_SPEC_K):
            raise ValueError(f"spec_k must be 0 (off) or in [2, {MAX_SPEC_K}], got {spec_k!r}")
        if spec_k and float(temperature) != 0:
            raise ValueError("spec_k > 0 needs greedy decoding (temperature 0)")
        if spec_k and float(repetition_penalty) != 1:
            raise ValueError("spec_k > 0 cannot be combined with repetition_penalty")
        if not isinstance(logprobs, bool):
            raise ValueError(f"logprobs must be True or False, got {logprobs!r}")
        if not is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
        if top_logprobs and not logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        stops = []
        for name, value in (("eos", eos), ("stop_token_ids", stop_token_ids)):
            if value is None:
                continue
            if is_int(value):
                value = [value]
            try:
                value = [int(v) if is_int(v) else v for v in value]
            except TypeError:
                raise ValueError(f"{name} must be a token id or a list of token ids") from None
            for v in value:
                if not is_int(v) or not 0 <= v < vocab:
                    raise ValueError(f"{name}: token ID is outside the vocabulary: {v!r} (vocab_size={vocab})")
            stops += value
        params = dict(max_new_tokens=max_new, temperature=float(temperature), top_p=float(top_p),
                      top_k=int(top_k), min_p=float(min_p), repetition_penalty=float(repetition_penalty),
                      seed=seed, eos=stops, priority=int(priority), spec_k=int(spec_k),
                      logprobs=logprobs, top_logprobs=int(top_logprobs))
        with self._inflight_lock:
            if self._closed:
                raise EngineClosed("the engine has been shut down")
            if self.max_queue is not None and self.queue_depth() >= self.max_queue:
                raise QueueFull(f"the engine's queue is full ({self.max_queue} waiting requests)")
            req = Request(self, next(self._ids), [int(x) for x in p], params)
            req._leader = _leader
            self._submitted += 1
            self._prompt_tokens += len(p)
            if max_new:
                self._inflight[req.id] = req
                self._inbox.append(req)
        if not max_new:
            req._finish("length", None)   # nothing to make
            return req
        self._wake()
        return req

    def submit_n(self, prompt, n, max_new_tokens=256, *, seed=0, **params):
        """n requests for one prompt (OpenAI's ``n``), seeds seed, seed + 1,
        ...: the first prefills the prompt, the others fork from its blocks
        (full blocks shared, copy on write for the tail) and its logits."""
        if not is_int(n) or not 1 <= n <= 128:
            raise ValueError(f"n must be an integer in [1, 128], got {n!r}")
        seed = check_seed(seed)
        first = self.submit(prompt, max_new_tokens, seed=seed, **params)
        out = [first]
        for i in range(1, n):
            out.append(self.submit(prompt, max_new_tokens, seed=(seed + i) % 2**64, _leader=first, **params))
        return out

    def generate(self, prompt, max_new_tokens=256, **params):
        """submit() and wait: the request's tokens."""
        return self.submit(prompt, max_new_tokens, **params).result()

    def queue_depth(self):
        """Requests waiting for admission (submitted, not yet running)."""
        return len(self._inbox) + self._stats.get("waiting", 0)

    def _finished(self, req):
        with self._inflight_lock:
            self._inflight.pop(req.id, None)
            self._outcomes[req.finish_reason] = self._outcomes.get(req.finish_reason, 0) + 1
        if req.first_token_at is not None:
            self.histograms["ttft_seconds"].observe(req.first_token_at - req.queued_at)

    # ---- stepping ----

    def _drain_inbox(self):
        core = self._core
        while self._inbox:
            req = self._inbox.popleft()
            p = req.params
            leader = req._leader._seq if req._leader is not None else None
            req._leader = None
            try:
                seq = core.add(req, req.id, req.prompt, p["max_new_tokens"], p["temperature"], p["top_p"],
                               p["top_k"], p["seed"], p["eos"], p["min_p"], p["repetition_penalty"],
                               p["priority"], p["spec_k"], p["logprobs"], p["top_logprobs"], leader)
            except Exception as e:   # (validated at submit: only memory can fail here)
                req._finish("error", e)
                continue
            if not seq.phase == 2:
                req._seq = seq
                if req._cancel:
                    seq.cancel()

    def step(self):
        """One step by hand (engines made with start=False): admit what was
        submitted, run one forward, choose tokens. Returns the tokens run."""
        if self._thread is not None:
            raise RuntimeError("this engine steps itself (made with start=True)")
        with self._core_lock:
            return self._step_locked()

    def _step_locked(self):
        self._drain_inbox()
        t0 = time.perf_counter()
        ran = self._core.step()
        t1 = time.perf_counter()
        if ran:
            self.histograms["step_seconds"].observe(t1 - t0)
        # the snapshot other threads read: every 50 ms while busy, and when idle
        if t1 - self._stats_at > 0.05 or not self._core.busy or self._thread is None:
            self._stats = self._core.stats()
            self._stats_at = t1
        return ran

    def run_until_idle(self, max_steps=None):
        """Step until nothing is queued or running (start=False engines)."""
        n = 0
        while self._inbox or self._core.busy:
            self.step()
            n += 1
            if max_steps is not None and n >= max_steps:
                break
        return n

    def _wake(self):
        with self._signal:
            self._signal.notify()

    def _has_work(self):
        return bool(self._inbox) or self._core.busy

    def _loop_once(self):
        """One step of the engine thread; False when it should end."""
        try:
            with self._core_lock:
                ran = self._step_locked()
        except BaseException as e:   # a bug: fail what is in flight, keep serving
            self._error = e
            self._fail_all(e)
            return True
        if not ran and self._core.busy:
            time.sleep(0.001)   # nothing could run this step (cannot last: see schedule)
        return True

    def _fail_all(self, error):
        core = self._core
        core.cancel_all()
        try:
            with self._core_lock:
                self._drain_inbox()
                core.step()
        except BaseException:
            pass
        with self._inflight_lock:
            left = list(self._inflight.values())
        for req in left:
            if not req.done:
                req._finish("error", RuntimeError(f"engine error: {error!r}"))

    # ---- life ----

    def shutdown(self, drain=True, timeout=None):
        """Stop accepting requests; with drain, let the queued and running
        ones finish, else cancel them (the forward in flight stops at its
        next layer). Waits for the engine thread (up to timeout seconds)."""
        self._closed = True
        if not drain:
            for req in list(self._inbox):
                req._cancel = True
            self._core.cancel_all()
            for req in list(self._inflight.values()):
                req.cancel()
            self._core.abort_forward()
        if self._thread is None:
            if not drain:
                with self._core_lock:
                    self._step_locked()
            else:
                self.run_until_idle()
            self._release_pool()
            return True
        with self._signal:
            self._stop = True
            self._signal.notify()
        if threading.current_thread() is self._thread:
            return False   # (the engine's own thread dropped the last reference)
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        if not alive:
            self._release_pool()
        return not alive

    close = shutdown

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown(drain=exc[0] is None)

    # ---- inspection ----

    def stats(self):
        """A dict: requests submitted, waiting and running, tokens in and
        out, preemptions, KV blocks used/free and cached, prefix-cache
        hits, misses and reused tokens, finishes by reason (as of the last step)."""
        out = dict(self._stats)
        out["waiting"] = out.get("waiting", 0) + len(self._inbox)
        out["queue_depth"] = out["waiting"]
        out["submitted"] = self._submitted
        out["prompt_tokens"] = self._prompt_tokens
        with self._inflight_lock:
            out.update({f"finished_{k}": v for k, v in self._outcomes.items()})
        return out

    @property
    def pool(self):
        """The engine's BlockPool (None for FWKV); inspect it only while no step runs."""
        return self._core.pool

    @property
    def running(self):
        return self._thread is not None and self._thread.is_alive()

    def check_invariants(self):
        """Assert the pool holds exactly the running requests' and the
        cache's blocks (for tests; takes the step lock)."""
        with self._core_lock:
            self._core.check_invariants()
