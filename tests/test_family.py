"""A toy model family written in this file, as docs/ARCHITECTURE.md's
"Adding a model family" describes: its config, its weights, its forward (a
Python ragged-step hook, cism._step.PyStepper) and the two hooks naming its
session and step classes. Everything else comes from the shared scaffold:
create_session / logits / nll / logits_all (cism._weights.WeightStore),
sampling, speculation and cancellation (cism._session), the engine. The
family is a tiny recurrent network, so its state goes through verification
blocks and the engine's prefix-cache snapshots too."""
import numpy as np
import pytest

import cism
from cism._session import StateSession
from cism._step import PyStepper
from cism._weights import WeightStore


class ToyConfig:
    def __init__(self, vocab=13, dim=6, context=64):
        self.vocab, self.dim, self.context = vocab, dim, context

    def canonical(self):
        return f"toy vocab={self.vocab} dim={self.dim} context={self.context}"


def toy_weights(c, seed=0):
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((c.vocab, c.dim)).astype(np.float32),
            "recur": (0.5 * rng.standard_normal((c.dim, c.dim))).astype(np.float32),
            "head": (2 * rng.standard_normal((c.vocab, c.dim))).astype(np.float32)}


def toy_step(w, token, h):
    """One token: h <- tanh(recur h + embed[token]); logits = head h."""
    h[:] = np.tanh(w["recur"] @ h + w["embed"][token])
    return w["head"] @ h


class ToyStepper(PyStepper):
    def __init__(self, model):
        PyStepper.__init__(self, model, model.config.vocab, model.config.dim)

    def forward_py(self, tokens, state):
        return np.stack([toy_step(self.model.w, t, state) for t in tokens])


class ToyModel(WeightStore):
    def __init__(self, config, weights, threads=1):
        self.begin(config, ToyConfig, "fp32", "fp32", threads, "toy-1")
        self.w = weights
        self.set_act_precision("fp32")   # (and the compile key)

    def session_class(self):
        return StateSession

    def stepper_class(self):
        return ToyStepper


# ---- the oracle: the same equations, one token at a time ----

def ref_logits(w, c, tokens):
    h = np.zeros(c.dim, np.float32)
    return np.stack([toy_step(w, t, h) for t in tokens])


def ref_greedy(w, c, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(ref_logits(w, c, tokens)[-1])))
    return tokens[len(prompt):]


@pytest.fixture
def toy():
    c = ToyConfig()
    w = toy_weights(c)
    return c, w, ToyModel(c, w)


def test_logits_and_nll_through_the_scaffold(toy):
    c, w, model = toy
    prompt = [1, 5, 2, 9, 4]
    want = ref_logits(w, c, prompt)
    assert np.array_equal(model.logits(prompt), want[-1])
    assert np.array_equal(model.logits_all(prompt), want)
    lp = want[:-1] - np.log(np.exp(want[:-1].astype(np.float64)).sum(1, keepdims=True))
    nll = -np.mean([lp[i, prompt[i + 1]] for i in range(len(prompt) - 1)])
    assert model.nll(prompt) == pytest.approx(nll, rel=1e-6)


def test_generation_speculation_and_sampling(toy):
    c, w, model = toy
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 2
    want = ref_greedy(w, c, prompt, 20)
    assert model.create_session(prompt, 20).next_tokens(20) == want
    s = model.create_session(prompt, 20)
    assert s.next_tokens(7, spec_k=4) + s.next_tokens(13, spec_k=4) == want
    # sampled: the shared sampler, one generator per seed
    a = model.create_session(prompt, 10, temperature=0.9, top_k=5, seed=7).next_tokens(10)
    assert a == model.create_session(prompt, 10, temperature=0.9, top_k=5, seed=7).next_tokens(10)
    assert all(0 <= t < c.vocab for t in a)


def test_the_engine_serves_the_toy_family(toy):
    c, w, model = toy
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3]]
    with cism.Engine(model, max_seqs=2) as engine:
        got = [engine.generate(p, 6) for p in prompts]
    assert got == [ref_greedy(w, c, p, 6) for p in prompts]
