"""The sampler against an independent Python statement of the spec's rule,
mt19937_64 against the C++ standard's values, the drafter, and the knobs."""
import math

import numpy as np
import pytest

from cism import sampling
from conftest import hypothesis_examples, hypothesis_or_skip


def test_mt19937_64_matches_the_cpp_standard():
    assert sampling.mt19937_64(5489, 1) == [14514284786278117030]
    # [rand.predef]: the 10000th invocation of a default-constructed mt19937_64
    assert sampling.mt19937_64(5489, 10000)[-1] == 9981545732273789042


def spec_sample(logits, temperature, top_p, top_k, u64):
    """The spec's Session::sample, written from its text (u64: the rng draw)."""
    logits = [float(np.float32(x)) for x in logits]
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    kept = top_k or len(order)
    order = order[:kept]
    m = logits[order[0]]
    probs = [math.exp((logits[i] - m) / temperature) for i in order]
    total = 0.0
    for p in probs:
        total += p
    nucleus = kept
    if top_p < 1:
        cum = 0.0
        for i, p in enumerate(probs):
            cum += p
            if cum >= top_p * total:
                nucleus, total = i + 1, cum
                break
    target = (u64 >> 11) * 2.0 ** -53 * total
    for i in range(nucleus):
        if target < probs[i]:
            return order[i]
        target -= probs[i]
    return order[nucleus - 1]


def test_sampler_matches_the_spec_rule():
    h = hypothesis_or_skip()
    st = h.strategies

    @h.settings(max_examples=hypothesis_examples(200), deadline=None)
    @h.given(n=st.integers(1, 300), seed=st.integers(0, 2**64 - 1), temperature=st.floats(0.05, 3),
             top_p=st.floats(0.01, 1.0), top_k=st.integers(0, 300), ties=st.booleans())
    def check(n, seed, temperature, top_p, top_k, ties):
        _sampler_matches_the_spec_rule(n, seed, temperature, top_p, top_k, ties)
    check()


def _sampler_matches_the_spec_rule(n, seed, temperature, top_p, top_k, ties):
    rng = np.random.default_rng(seed % 2**32)
    logits = rng.standard_normal(n).astype(np.float32) * 3
    if ties:
        logits = np.round(logits)  # many equal logits: the index tie-break decides
        logits[rng.integers(0, n, max(1, n // 5))] = -0.0
    top_k = min(top_k, n)
    draws = sampling.mt19937_64(seed, 3)
    got = sampling.sample(logits, temperature, top_p, top_k, seed, draws=3)
    # each draw uses the next generator output; the logits stay the same
    want = [spec_sample(logits, temperature, top_p, top_k, u) for u in draws]
    assert got == want


def test_greedy_and_degenerate_settings():
    logits = np.array([0.5, 3.0, 3.0, -1.0], np.float32)
    assert sampling.sample(logits, 0.0) == [1]  # first maximum
    assert sampling.sample(logits, 2.0, top_k=1, seed=7, draws=5) == [1] * 5
    assert sampling.sample(logits, 2.0, top_p=1e-12, seed=7, draws=5) == [1] * 5
    # min_p = 1 keeps only the maximal tokens
    assert set(sampling.sample(logits, 5.0, min_p=1.0, seed=3, draws=20)) == {1, 2}


def test_repetition_penalty_follows_hf():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(50).astype(np.float32)
    history = [3, 7, 7, 12, 40]
    for penalty in (1.3, 0.7):
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]),
                                                         torch.tensor(logits[None]))[0].numpy()
        assert sampling.sample(logits, 0.0, repetition_penalty=penalty, history=history) == [int(np.argmax(want))]
        for seed in range(20):
            assert (sampling.sample(logits, 0.8, seed=seed, repetition_penalty=penalty, history=history)
                    == sampling.sample(want, 0.8, seed=seed))


def test_min_p_cut():
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04], np.float64)).astype(np.float32)
    # p >= 0.15 * 0.5 keeps tokens 0, 1 and 2: sampling over them equals top_k=3
    for seed in range(30):
        assert (sampling.sample(logits, 1.0, seed=seed, min_p=0.15)
                == sampling.sample(logits, 1.0, seed=seed, top_k=3))


def test_bad_knobs():
    z = np.zeros(4, np.float32)
    for kw, msg in [(dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
                    (dict(repetition_penalty=0.0), "repetition_penalty"),
                    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                    (dict(top_k=5), "top_k"), (dict(seed=-3), "seed")]:
        with pytest.raises(ValueError, match=msg):
            sampling.sample(z, **kw)
    with pytest.raises(ValueError, match="finite"):
        sampling.sample(np.array([np.nan, 1], np.float32))


def spec_draft(history, k):
    """The spec's prompt_lookup_draft (v4), from its text."""
    cand = []
    h = len(history)
    if k == 0 or h < 2:
        return cand
    for _ in range(k):
        total = h + len(cand)
        placed = False
        for pattern in range(min(3, total - 1), 0, -1):
            if pattern >= h:
                continue
            for s in range(h - pattern - 1, -1, -1):
                ctx = [(history + cand)[total - pattern + o] for o in range(pattern)]
                if history[s:s + pattern] == ctx:
                    cand.append(history[s + pattern])
                    placed = True
                    break
            if placed:
                break
        if not placed:
            break
    return cand


def test_drafter_matches_the_spec_rule():
    h = hypothesis_or_skip()
    st = h.strategies

    @h.settings(max_examples=hypothesis_examples(300), deadline=None)
    @h.given(history=st.lists(st.integers(0, 5), max_size=40), k=st.integers(0, 16))
    def check(history, k):
        _drafter_matches_the_spec_rule(history, k)
    check()


def _drafter_matches_the_spec_rule(history, k):
    assert sampling.draft(history, k) == spec_draft(history, k)
