"""cism.Engine: every request bit-identical to a solo session (tokens and
logprobs) whatever shares its steps, for all three families; a hypothesis
state machine of arrivals, cancellations, priorities, tiny pools (forcing
preemption) and shared prefixes with the pool's invariants after every step;
threads and asyncio consumers; prefix-cache accounting; recovery paths;
validation messages."""
import asyncio
import gc
import random
import threading
import time

import numpy as np
import pytest

import cism
from cism.engine import Engine, EngineClosed, QueueFull
from cism.sampling import logprobs as ref_logprobs

from conftest import hypothesis_or_skip
from models import small_model
import test_fwkv
import test_surjo

FAMILIES = ("dense", "surjo", "fwkv")
_MODELS = {}


def model_of(family, precision="fp32", threads=2, act_precision="fp32", kv_precision="fp32"):
    key = (family, precision, threads, act_precision, kv_precision)
    if key not in _MODELS:
        if family == "dense":
            m = small_model(precision=precision, threads=threads, kv_precision=kv_precision)
            m.set_act_precision(act_precision)
        elif family == "surjo":
            m = test_surjo.make(precision=precision, threads=threads, act_precision=act_precision,
                                kv_precision=kv_precision)
        else:
            m = test_fwkv.model(precision, threads=threads, act_precision=act_precision)
        _MODELS[key] = m
    return _MODELS[key]


SOLO_KEYS = ("temperature", "top_p", "top_k", "seed", "eos", "min_p", "repetition_penalty")


def solo(model, prompt, max_new, params):
    """The oracle: a solo session, token by token, with the logprobs of each
    token computed from the session's own logits."""
    kw = {k: v for k, v in params.items() if k in SOLO_KEYS}
    s = model.create_session(prompt, max_new, kw.pop("temperature", 0.0), kw.pop("top_p", 1.0),
                             kw.pop("top_k", 0), kw.pop("seed", 0), kw.pop("eos", ()), **kw)
    tokens, lps, tops = [], [], []
    if max_new == 0:
        return tokens, lps, tops, s.finish_reason
    s.prefill()
    top_n = params.get("top_logprobs", 0)
    while not s.finish_reason:
        logits = s.last_logits
        t = s.next_tokens(1)
        if not t:
            break
        tokens += t
        lp, top = ref_logprobs(logits, t[0], top_n)
        lps.append(lp)
        tops.append(top)
    return tokens, lps, tops, s.finish_reason


def assert_matches_solo(model, req, cancelled_ok=True):
    p = req.params
    tokens, lps, tops, reason = solo(model, req.prompt, p["max_new_tokens"], p)
    if req.finish_reason == "cancelled" and cancelled_ok:
        assert req.tokens == tokens[:len(req.tokens)], req
        n = len(req.tokens)
    else:
        assert req.finish_reason == reason, (req, reason)
        assert req.tokens == tokens, req
        n = len(tokens)
    if p["logprobs"]:
        assert req.logprobs == lps[:n]   # bit for bit (floats compare exactly)
        assert req.top_logprobs == tops[:n]


def run(engine, check=True, max_idle=50):
    """Step until idle; a step that runs nothing while work remains, many
    times over, is a livelock (fails instead of hanging)."""
    idle = 0
    while engine._inbox or engine._core.busy:
        ran = engine.step()
        if check:
            engine.check_invariants()
        idle = 0 if ran else idle + 1
        assert idle < max_idle, f"the engine makes no progress: {engine.stats()}"


# ------------------------------------------------------ exactness, directly ---

@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_requests_equal_solo_sessions(family):
    m = model_of(family)
    vocab = m.config.vocab
    rng = np.random.default_rng(7)
    system = rng.integers(0, vocab, 37).tolist()
    with Engine(m, kv_blocks=40, max_seqs=6, max_step_tokens=48, start=False) as eng:
        reqs = []
        for i in range(12):
            prompt = (system if i % 2 else []) + rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
            params = dict(temperature=[0.0, 0.8, 1.3][i % 3], top_p=[1.0, 0.9][i % 2], top_k=[0, 5][i % 2],
                          seed=i, logprobs=True, top_logprobs=i % 4,
                          min_p=0.05 if i % 5 == 1 else 0.0, repetition_penalty=1.2 if i % 6 == 2 else 1.0,
                          eos=[int(rng.integers(0, vocab))] if i % 3 == 0 else [])
            reqs.append(eng.submit(prompt, int(rng.integers(0, 30)), **params))
            if i % 4 == 3:
                eng.step()
        run(eng)
        for r in reqs:
            assert r.done and r.error is None
            assert_matches_solo(m, r)
        st_ = eng.stats()
        assert st_["prefix_hits"] >= 1           # the system prompt was reused
        assert sum(st_[f"finished_{k}"] for k in ("stop", "length", "cancelled", "error")) == len(reqs)


@pytest.mark.parametrize("kind,kw", [("mistral", dict(sliding_window=11)), ("qwen2", dict(qkv_bias=True)),
                                     ("llama", dict(rope_scaling=("llama3", 8.0, 1.0, 4.0, 16))),
                                     ("qwen2", dict(qkv_bias=True,
                                                    rope_scaling=("yarn", 4.0, 16, 32.0, 1.0, 1.14, True)))])
def test_architectures_in_the_engine_equal_solo(kind, kw):
    """Windows over the paged pool (and prefix-cache hits, chunks and
    batches that cut through them), biases, scaled rope: solo's bits."""
    m = small_model(kind, **kw)
    rng = np.random.default_rng(11)
    system = rng.integers(0, 97, 35).tolist()
    with Engine(m, kv_blocks=40, max_seqs=5, max_step_tokens=24, start=False) as eng:
        reqs = [eng.submit(system + rng.integers(0, 97, int(rng.integers(1, 30))).tolist(), 24,
                           temperature=0.6 * (i % 2), seed=i, logprobs=True) for i in range(8)]
        run(eng)
        for r in reqs:
            assert_matches_solo(m, r)
        assert eng.stats()["prefix_hits"] >= 1


@pytest.mark.parametrize("family,precision,act,kv", [
    ("dense", "fp16", "fp32", "fp16"), ("dense", "int8", "int8", "fp32"),
    ("dense", "hybrid-int4", "int8", "fp32"), ("surjo", "int8", "int8", "fp16"),
    ("fwkv", "hybrid-fp4", "int8", "fp32"), ("dense", "int4", "int8", "fp16"),
    ("surjo", "fp4", "int8", "fp32"), ("fwkv", "int4", "int8", "fp32")])
def test_precisions_and_kv_layouts_equal_solo(family, precision, act, kv):
    m = model_of(family, precision, act_precision=act, kv_precision=kv)
    rng = np.random.default_rng(3)
    with Engine(m, kv_blocks=24, max_step_tokens=32, start=False) as eng:
        reqs = [eng.submit(rng.integers(0, m.config.vocab, int(rng.integers(1, 50))).tolist(), 16,
                           temperature=0.7 * (i % 2), seed=i, logprobs=True) for i in range(6)]
        run(eng)
        for r in reqs:
            assert_matches_solo(m, r)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_rides_in_the_step_and_changes_nothing(family):
    m = model_of(family)
    rng = np.random.default_rng(11)
    base = rng.integers(0, m.config.vocab, 7).tolist()
    prompts = [(base * 8)[:int(rng.integers(10, 56))] for _ in range(5)]
    with Engine(m, kv_blocks=40, max_step_tokens=40, start=False) as eng:
        spec = [eng.submit(p, 40, spec_k=k, logprobs=True) for p, k in zip(prompts, (2, 4, 8, 16, 5))]
        plain = [eng.submit(p, 40, seed=3, temperature=0.9) for p in prompts]
        run(eng)
        for r in spec + plain:
            assert_matches_solo(m, r)
        assert eng.stats()["spec_accepted"] > 0


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_changes_no_bit(threads):
    m = model_of("dense", threads=threads)
    ref = model_of("dense", threads=2)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 97, int(rng.integers(1, 60))).tolist() for _ in range(6)]
    with Engine(m, kv_blocks=32, start=False) as eng:
        reqs = [eng.submit(p, 20, temperature=0.8, seed=i, logprobs=True) for i, p in enumerate(prompts)]
        run(eng)
    for r in reqs:
        assert_matches_solo(ref, r)


# ------------------------------------------------ the state machine (hypothesis) ---

def engine_machine(kind):
    """The state machine class for one family, built by its test so that only
    that test needs hypothesis."""
    st = hypothesis_or_skip().strategies
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

    class EngineMachine(RuleBasedStateMachine):
        """Random arrivals, cancellations, priorities and steps on tiny pools;
        the pool's references checked after every step; every request checked
        against a solo session at the end."""
        family = kind

        def __init__(self):
            super().__init__()
            self.engine = None
            self.reqs = []

        @initialize(kv_blocks=st.integers(5, 20), max_seqs=st.integers(1, 5), budget=st.integers(1, 40),
                    caching=st.booleans(), seed=st.integers(0, 2**16))
        def start(self, kv_blocks, max_seqs, budget, caching, seed):
            self.model = model_of(self.family)
            self.vocab = self.model.config.vocab
            self.kv_blocks = kv_blocks
            rng = random.Random(seed)
            self.prefixes = [[rng.randrange(self.vocab) for _ in range(n)] for n in (0, 16, 23, 40)]
            pattern = [rng.randrange(self.vocab) for _ in range(5)]
            self.prefixes.append(pattern * 8)   # repeats: prompt lookup finds drafts
            self.engine = Engine(self.model, kv_blocks=kv_blocks, max_seqs=max_seqs, max_step_tokens=budget,
                                 prefix_caching=caching, aging_steps=3, start=False)

        @rule(prefix=st.integers(0, 4), tail=st.lists(st.integers(0, 40), min_size=0, max_size=30),
              max_new=st.integers(1, 24), mode=st.sampled_from(["greedy", "sample", "spec"]),
              priority=st.integers(-2, 2), seed=st.integers(0, 2**64 - 1), lp=st.booleans())
        def submit(self, prefix, tail, max_new, mode, priority, seed, lp):
            prompt = self.prefixes[prefix][:40] + [t % self.vocab for t in tail]
            if not prompt:
                prompt = [1]
            room = self.kv_blocks * 16
            if len(prompt) + max_new > room:
                prompt = prompt[:max(1, room - max_new)]
                max_new = min(max_new, room - len(prompt))
            kw = dict(priority=priority, seed=seed, logprobs=lp, top_logprobs=2 if lp else 0)
            if mode == "sample":
                kw.update(temperature=0.9, top_k=20)
            elif mode == "spec":
                kw.update(spec_k=4)
            self.reqs.append(self.engine.submit(prompt, max_new, **kw))

        @rule(prefix=st.integers(0, 4), n=st.integers(2, 3), seed=st.integers(0, 2**32))
        def submit_n(self, prefix, n, seed):
            prompt = self.prefixes[prefix][:40] + [seed % self.vocab]
            self.reqs += self.engine.submit_n(prompt, n, 6, temperature=0.8, seed=seed)

        @precondition(lambda self: self.reqs)
        @rule(data=st.data())
        def cancel(self, data):
            data.draw(st.sampled_from(self.reqs)).cancel()

        @rule(n=st.integers(1, 5))
        def step(self, n):
            for _ in range(n):
                self.engine.step()
                self.engine.check_invariants()

        @invariant()
        def finishes_are_single(self):
            if self.engine is not None:
                st_ = self.engine.stats()
                finished = sum(st_[f"finished_{k}"] for k in ("stop", "length", "cancelled", "error"))
                assert finished == sum(r.done for r in self.reqs)

        def teardown(self):
            if self.engine is None:
                return
            run(self.engine)
            pool = self.engine.pool
            if pool is not None:
                # idle: only the cache holds blocks
                assert pool.phys_used() == self.engine.stats()["cached_blocks"]
            for r in self.reqs:
                assert r.done and r.error is None, r
                assert_matches_solo(self.model, r)
            self.engine.shutdown()

    return EngineMachine


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_machine(family):
    machine = engine_machine(family)
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(machine, settings=settings(max_examples=25, stateful_step_count=40, deadline=None,
                                                         suppress_health_check=[HealthCheck.too_slow]))


# --------------------------------------------------------- threads and asyncio ---

@pytest.mark.parametrize("family", ["dense", "surjo"])
def test_many_threads_submit_and_cancel_at_once(family):
    m = model_of(family)
    vocab = m.config.vocab
    prompts = [np.random.default_rng(i).integers(0, vocab, 1 + i * 7 % 45).tolist() for i in range(32)]
    done = []
    with Engine(m, kv_blocks=20, max_seqs=6) as eng:    # small: preemption under threads
        def worker(w):
            rng = random.Random(w)
            for j in range(4):
                i = w * 4 + j
                req = eng.submit(prompts[i], 24, temperature=0.8 if i % 2 else 0.0, seed=i,
                                 logprobs=bool(i % 3), spec_k=4 if i % 4 == 0 else 0)
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 0.01)
                    req.cancel()
                done.append(req)
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in done:
            assert r.wait(60)
        eng.check_invariants()
        assert eng.pool.phys_used() == eng.stats()["cached_blocks"]
    assert len(done) == 32
    for r in done:
        assert r.error is None
        assert_matches_solo(m, r)


def test_asyncio_consumers_stream_every_token():
    m = model_of("dense")
    prompts = [np.random.default_rng(i).integers(0, 97, 5 + 3 * i).tolist() for i in range(10)]

    async def main(eng):
        async def one(i):
            req = eng.submit(prompts[i], 20, temperature=0.9, seed=i)
            seen = [t async for t in req]
            return req, seen
        return await asyncio.gather(*(one(i) for i in range(10)))

    with Engine(m, kv_blocks=24) as eng:
        results = asyncio.run(main(eng))
    for req, seen in results:
        assert seen == req.tokens
        assert_matches_solo(m, req)
        assert req.queued_at <= req.first_token_at <= req.finished_at


def test_blocking_iterator_and_timings():
    m = model_of("dense")
    with Engine(m, kv_blocks=16) as eng:
        req = eng.submit([1, 2, 3, 4, 5], 12, temperature=0.5, seed=9)
        seen = list(req)
        assert seen == req.tokens == req.result()
        assert req.finish_reason == "length" and len(seen) == 12
        assert 0 <= req.ttft <= req.latency
        h = eng.histograms["ttft_seconds"].snapshot()
        assert h["count"] >= 1


# ---------------------------------------------------------------- prefix cache ---

@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_give_the_bits_of_misses(family):
    m = model_of(family)
    rng = np.random.default_rng(2)
    system = rng.integers(0, m.config.vocab, 70).tolist()    # 4 full blocks and a tail
    users = [rng.integers(0, m.config.vocab, 9).tolist() for _ in range(3)]
    with Engine(m, kv_blocks=40, start=False) as eng:
        first = eng.submit(system + users[0], 8, logprobs=True)
        run(eng)
        s = eng.stats()
        assert (s["prefix_hits"], s["prefix_misses"]) == (0, 1)
        assert s["cached_blocks"] >= 4 or family == "fwkv"
        later = [eng.submit(system + u, 8, logprobs=True, temperature=0.8, seed=4) for u in users]
        run(eng)
        s = eng.stats()
        assert s["prefix_hits"] == 3 and s["prefix_misses"] == 1
        assert s["prefix_hit_tokens"] == 3 * 64
        for r in [first] + later:
            assert_matches_solo(m, r)
        assert all(r.cached_tokens == 64 for r in later)
        assert 0 < s["prefix_hit_rate"] <= 1
    with Engine(m, kv_blocks=40, start=False, prefix_caching=False) as eng:
        r = eng.submit(system + users[1], 8, logprobs=True, temperature=0.8, seed=4)
        run(eng)
        assert r.cached_tokens == 0
        assert r.tokens == later[1].tokens and r.logprobs == later[1].logprobs


@pytest.mark.parametrize("family", ["dense", "surjo"])
def test_cached_blocks_are_reclaimed_under_pressure(family):
    m = model_of(family)
    rng = np.random.default_rng(4)
    with Engine(m, kv_blocks=12, start=False) as eng:
        for i in range(6):   # each leaves ~4 cached blocks: more than the pool
            r = eng.submit(rng.integers(0, m.config.vocab, 66).tolist(), 4, seed=i)
            run(eng)
            assert r.finish_reason == "length"
            assert_matches_solo(m, r)
        s = eng.stats()
        assert s["evicted_blocks"] > 0
        assert s["cached_blocks"] <= 12 and s["kv_blocks_used"] == s["cached_blocks"]


def test_a_shared_prompt_is_computed_once_when_requests_queue():
    m = model_of("dense")
    system = list(range(1, 81))
    with Engine(m, kv_blocks=64, max_seqs=1, start=False) as eng:   # one at a time
        reqs = [eng.submit(system + [90 + i], 4) for i in range(4)]
        run(eng)
        assert [r.cached_tokens for r in reqs] == [0, 80, 80, 80]
        for r in reqs:
            assert_matches_solo(m, r)


@pytest.mark.parametrize("family", FAMILIES)
def test_n_completions_prefill_their_prompt_once(family):
    m = model_of(family)
    prompt = np.random.default_rng(6).integers(0, m.config.vocab, 45).tolist()
    with Engine(m, kv_blocks=40, start=False) as eng:
        reqs = eng.submit_n(prompt, 4, 12, temperature=0.9, seed=5, logprobs=True)
        run(eng)
        assert [r.cached_tokens for r in reqs] == [0, 45, 45, 45]
        assert eng.stats()["tokens_run"] == 45 + 4 * 11    # the prompt once, then decode
        assert [r.params["seed"] for r in reqs] == [5, 6, 7, 8]
        for r in reqs:
            assert_matches_solo(m, r)
        # a follower whose leader is cancelled before its prefill runs is admitted alone
        lead, follow = eng.submit_n(prompt, 2, 6, seed=1)
        lead.cancel()
        run(eng)
        assert lead.finish_reason == "cancelled" and follow.finish_reason == "length"
        assert_matches_solo(m, follow)


# ----------------------------------------------------- scheduling and recovery ---

def test_preempted_requests_recompute_and_priority_wins():
    m = model_of("dense")
    rng = np.random.default_rng(8)
    with Engine(m, kv_blocks=10, max_seqs=8, prefix_caching=False, start=False) as eng:
        low = [eng.submit(rng.integers(0, 97, 30).tolist(), 40, priority=0, seed=i, temperature=0.7)
               for i in range(3)]
        for _ in range(6):
            eng.step()
            eng.check_invariants()
        high = eng.submit(rng.integers(0, 97, 40).tolist(), 60, priority=5)
        run(eng)
        assert eng.stats()["preemptions"] > 0
        assert sum(r.preemptions for r in low) > 0 and high.preemptions == 0
        # the high-priority request was served before the preempted ones finished
        assert high.finished_at <= max(r.finished_at for r in low)
        for r in low + [high]:
            assert_matches_solo(m, r)


def test_aging_lets_low_priority_through_a_high_priority_stream():
    m = model_of("dense")
    with Engine(m, kv_blocks=8, max_seqs=1, aging_steps=2, start=False) as eng:
        low = eng.submit(list(range(1, 20)), 8, priority=-10)
        stream = []
        for i in range(80):   # a new high-priority request whenever one finishes
            if not any(not r.done for r in stream):
                stream.append(eng.submit(list(range(30, 45)), 6, priority=10, seed=i))
            eng.step()
            if low.done:
                break
        assert low.done and low.finish_reason == "length"
        assert_matches_solo(m, low)


def test_out_of_memory_in_a_step_preempts_and_loses_nothing():
    m = model_of("surjo")
    rng = np.random.default_rng(1)
    with Engine(m, kv_blocks=30, start=False) as eng:
        reqs = [eng.submit(rng.integers(0, m.config.vocab, 20).tolist(), 12, seed=i, temperature=0.6)
                for i in range(4)]
        eng.step()
        eng.step()
        eng._core._inject_forward_result("nomem")
        eng.step()
        eng.check_invariants()
        assert eng.stats()["preemptions"] == 4
        run(eng)
        for r in reqs:
            assert_matches_solo(m, r)
        # a one-token step that still fails fails its request, and only it
        lone = eng.submit([3, 4, 5], 4)
        eng.step()     # prefill (three tokens)
        eng._core._inject_forward_result("nomem")
        eng.step()     # one decode token
        assert lone.finish_reason == "error" and isinstance(lone.error, MemoryError)
        with pytest.raises(MemoryError, match="out of memory in the engine's forward"):
            lone.result()
        after = eng.submit([3, 4, 5], 4)
        run(eng)
        assert_matches_solo(m, after)


def test_non_finite_logits_fail_only_their_request():
    m = model_of("dense")
    with Engine(m, kv_blocks=16, start=False) as eng:
        bad = eng.submit([4, 13, 5], 6)
        good = eng.submit([1, 2, 3], 6, seed=1, temperature=0.5)
        eng._core._inject_forward_result("nonfinite")   # the first row of the step: bad's
        run(eng)
        assert bad.finish_reason == "error" and "non-finite" in str(bad.error)
        assert good.finish_reason == "length"
        assert_matches_solo(m, good)


def test_non_finite_attention_score_fails_the_step():
    """A step whose forward meets a non-finite attention score stops there
    (no row holds logits), so its requests fail with the spec's message, even
    when the bad token is out of the logits rows' sliding window."""
    from cism.dense import Model
    from models import small_config
    from test_dense import _one_token_overflows_attention
    config = small_config("mistral", sliding_window=4)
    m = Model(config, _one_token_overflows_attention(config), "fp32", threads=1)
    with Engine(m, kv_blocks=16, start=False) as eng:
        bad = eng.submit([1, 5] + [2, 3, 4] * 13, 4)
        run(eng)
        assert bad.finish_reason == "error" and str(bad.error) == "non-finite attention score"
        good = eng.submit([1, 2, 3], 4)
        run(eng)
        assert good.finish_reason == "length"


def test_zero_new_tokens_finish_at_once():
    m = model_of("dense")
    with Engine(m, kv_blocks=8, start=False) as eng:
        r = eng.submit([1, 2, 3], 0)
        assert r.done and r.finish_reason == "length" and r.tokens == []


# ------------------------------------------------------------ life and errors ---

def test_shutdown_drains_or_cancels():
    m = model_of("dense")
    eng = Engine(m, kv_blocks=16)
    reqs = [eng.submit([1, 2, 3, i], 30, seed=i, temperature=0.9) for i in range(4)]
    assert eng.shutdown(drain=True, timeout=60)
    assert all(r.finish_reason == "length" for r in reqs)
    with pytest.raises(EngineClosed, match="the engine has been shut down"):
        eng.submit([1], 1)
    eng = Engine(m, kv_blocks=16, start=False)
    reqs = [eng.submit([1, 2, 3, i], 30) for i in range(4)]
    eng.step()
    eng.shutdown(drain=False)
    assert all(r.finish_reason == "cancelled" for r in reqs)
    assert eng.pool.phys_used() == eng.stats()["cached_blocks"]


def test_queue_full_and_cancel_before_admission():
    m = model_of("dense")
    with Engine(m, kv_blocks=16, max_queue=2, start=False) as eng:
        a = eng.submit([1, 2], 3)
        b = eng.submit([1, 3], 3)
        with pytest.raises(QueueFull, match="queue is full"):
            eng.submit([1, 4], 3)
        b.cancel()
        run(eng)
        assert a.finish_reason == "length" and b.finish_reason == "cancelled" and b.tokens == []


def test_manual_step_refused_while_the_thread_runs():
    with Engine(model_of("dense"), kv_blocks=8) as eng:
        with pytest.raises(RuntimeError, match="steps itself"):
            eng.step()


def test_engine_without_references_stops_its_thread():
    eng = Engine(model_of("dense"), kv_blocks=8)
    thread = eng._thread
    eng.submit([1, 2, 3], 4).wait(30)
    del eng
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.parametrize("kw,message", [
    (dict(prompt=[], max_new_tokens=3), "at least one token"),
    (dict(prompt=[1, 200], max_new_tokens=3), "outside the vocabulary"),
    (dict(prompt="hello", max_new_tokens=3), "not text"),
    (dict(prompt=[1], max_new_tokens=-1), "max_new_tokens"),
    (dict(prompt=[1], max_new_tokens=600), "exceeds the context length"),
    (dict(prompt=[1] * 200, max_new_tokens=200), "more than the engine's whole pool"),
    (dict(prompt=[1], temperature=-1), "temperature"),
    (dict(prompt=[1], top_p=0), "top_p"),
    (dict(prompt=[1], top_k=1000), "top_k"),
    (dict(prompt=[1], min_p=2), "min_p"),
    (dict(prompt=[1], repetition_penalty=0), "repetition_penalty"),
    (dict(prompt=[1], seed=-1), "seed"),
    (dict(prompt=[1], priority=2**40), "priority"),
    (dict(prompt=[1], spec_k=1), "spec_k"),
    (dict(prompt=[1], spec_k=4, temperature=0.5), "greedy"),
    (dict(prompt=[1], logprobs="yes"), "logprobs"),
    (dict(prompt=[1], top_logprobs=3), "needs logprobs"),
    (dict(prompt=[1], logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(prompt=[1], eos=[500]), "eos"),
    (dict(prompt=[1], stop_token_ids=["a"]), "stop_token_ids"),
])
def test_submit_validation_messages(kw, message):
    kw = dict({"max_new_tokens": 3}, **kw)
    with Engine(model_of("dense"), kv_blocks=16, start=False) as eng:
        with pytest.raises(ValueError, match=message):
            eng.submit(**kw)
        assert eng.stats()["submitted"] == 0


@pytest.mark.parametrize("kw,message", [
    (dict(max_seqs=0), "max_seqs"), (dict(max_step_tokens=0), "max_step_tokens"),
    (dict(kv_blocks=0), "kv_blocks"), (dict(max_queue=-1), "max_queue"),
    (dict(aging_steps=0), "aging_steps"), (dict(snapshot_bytes=-1), "snapshot_bytes")])
def test_engine_validation_messages(kw, message):
    with pytest.raises(ValueError, match=message):
        Engine(model_of("dense"), start=False, **kw)


def test_the_pool_counts_against_the_kv_budget():
    m = small_model(threads=1)
    m.set_kv_budget(10 * 2 * 16 * 32 * 4 * 2)   # room for 10 blocks of this model
    with pytest.raises(ValueError, match="KV budget exceeded"):
        Engine(m, kv_blocks=11, start=False)
    eng = Engine(m, start=False)     # the default fits the budget
    assert eng.pool.num_blocks == 10 and m.kv_in_use == m.kv_budget
    eng.shutdown()
    assert m.kv_in_use == 0
