"""FWKV: parity with the NumPy reference (tests/reference/fwkv.py) through
safetensors checkpoints, every precision, block vs single steps bit for bit,
speculative == greedy with the state exact after every call, thread and ISA
invariance, cancellation, text through the GPT-2 tokenizer, and every
validation message."""
import json
from fractions import Fraction as Q
import threading
import time

import numpy as np
import pytest

import cism
from cism import _kernels
from cism.fwkv import Config, Model, weight_shapes
from tests.reference import exact as E
from tests.reference import fwkv as ref

from conftest import runnable_isas
from memlock import check_lock_pages

PRECISIONS = ["fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"]
MATRICES = ("proj_k.weight", "proj_v.weight", "proj_r.weight", "proj_out.weight",
            "ffn.0.weight", "ffn.2.weight")


# ----------------------------------------------------------------- models ---

def config(**kw):
    base = dict(d_model=48, d_emb=20, layers=2, vocab=97, ffn_mult=2, context=512)
    base.update(kw)
    return Config(**base)


def ref_config(c):
    return ref.make_config(d_model=c.d_model, d_emb=c.d_emb, layers=c.layers, vocab=c.vocab,
                           ffn_mult=c.ffn_mult, context=c.context, wkv_floor=c.wkv_floor)


def weights(c, seed=0):
    """The reference's random init, made lively: with the published 0.1
    residual scale and decays near 0.999, random models mostly echo their
    last input token, so the residual branches get a gain of 30 and the decay
    logits span (-4, 2), plus a few extremes that hit the floor and the clamp."""
    w = ref.random_weights(ref_config(c), seed)
    rng = np.random.default_rng(seed + 1000)
    for i in range(c.layers):
        for name in ("proj_out.weight", "ffn.2.weight"):
            w[f"blocks.{i}.{name}"] *= np.float32(30)
        decay = rng.uniform(-4, 2, c.d_model).astype(np.float32)
        decay[:2] = (-12, 9)
        w[f"blocks.{i}.w"] = decay
    w["shared.weight"] *= np.float32(0.5)
    return w


def model(precision="fp32", threads=2, seed=0, act_precision="fp32", **kw):
    c = config(**kw)
    return Model(c, weights(c, seed), precision, threads=threads, act_precision=act_precision)


def save_dir(path, c, w):
    import safetensors.numpy
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(c.to_hf()))
    safetensors.numpy.save_file(w, str(path / "model.safetensors"))
    return path


def rel_err(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def repetitive_prompt(vocab, seed=4):
    base = list(np.random.default_rng(seed).integers(0, vocab, 12))
    return base + base + base[:5]  # the prompt-lookup drafter finds matches


# ------------------------------------------------------ reference parity ---

PARITY = {
    "small": dict(),
    "odd-widths-floor0": dict(d_model=40, d_emb=12, layers=3, vocab=61, ffn_mult=3, wkv_floor=0.0),
    # more than one 64-column chunk in the recurrence and in shared.projᵀ
    "wide": dict(d_model=136, d_emb=70, layers=2, vocab=131, ffn_mult=1, wkv_floor=0.3),
}


@pytest.mark.parametrize("case", sorted(PARITY))
def test_safetensors_checkpoint_matches_reference(case, tmp_path):
    c = config(**PARITY[case])
    w = weights(c, seed=len(case))
    d = save_dir(tmp_path / "m", c, w)
    m = Model.from_pretrained(d, threads=2)
    assert m.config == c == Config.from_hf(json.loads((d / "config.json").read_text()))
    assert isinstance(cism.load(d), Model)
    rc = ref_config(c)
    tokens = list(np.random.default_rng(1).integers(0, c.vocab, 40))
    want = ref.logits(rc, w, tokens)
    assert rel_err(m.logits_all(tokens), want) < 1e-4
    assert rel_err(m.logits(tokens), want[-1]) < 1e-4
    assert m.create_session(tokens[:6], 24).next_tokens(24) == ref.greedy(rc, w, tokens[:6], 24)
    assert abs(m.nll(tokens) - ref.nll(rc, w, tokens)) < 1e-4 * max(1.0, abs(ref.nll(rc, w, tokens)))
    # the WKV state after the prompt
    s = m.create_session(tokens, 1)
    assert not s.state.any() and s.state.shape == (c.layers, c.d_model)
    s.next_tokens(0)
    s._prefill_now()
    state = ref.init_state(rc)
    ref.forward(rc, w, state, tokens)
    assert rel_err(s.state, state) < 1e-4


# ---------------------------------------------- by hand, in exact rationals ---

# One layer, d_model = 3, d_emb = 2, ffn_mult = 1, a vocabulary of 3; every weight a
# small dyadic rational, so the float32 model holds exactly these values. The
# decay logits w = (-3, 100, 0) put sigmoid(w) below the floor, above the
# clamp and at 1/2; proj_out is large so the WKV state shows in the logits
# through the 0.1 residual. (d_model = 2 would not do: a LayerNorm of two
# values is (+-1, -+1) * weight + bias whatever they are, up to eps.)
HAND = {"shared.weight": [[1, Q(-1, 2)], [Q(1, 4), 1], [Q(-3, 4), Q(1, 2)]],     # E (vocab, d_emb)
        "shared.proj.weight": [[1, Q(1, 2)], [Q(-1, 2), 1], [Q(1, 4), Q(-3, 4)]],   # P (d_model, d_emb)
        "norm.weight": [1, Q(1, 2), Q(3, 4)], "norm.bias": [Q(1, 4), Q(-1, 4), 0],
        "blocks.0.proj_k.weight": [[Q(1, 2), Q(1, 4), 0], [Q(-1, 4), 1, Q(1, 2)], [0, Q(-1, 2), 1]],
        "blocks.0.proj_v.weight": [[1, Q(-1, 2), Q(1, 4)], [Q(1, 2), Q(1, 4), 0], [-1, 0, Q(1, 2)]],
        "blocks.0.proj_r.weight": [[Q(1, 2), 0, 0], [0, -1, Q(1, 4)], [Q(1, 4), 0, 1]],
        "blocks.0.proj_out.weight": [[8, 4, 0], [-4, 8, 2], [2, -2, 8]],
        "blocks.0.w": [-3, 100, 0],
        "blocks.0.ffn.0.weight": [[1, -1, 0], [Q(1, 2), 1, Q(-1, 2)], [0, Q(1, 4), 1]],
        "blocks.0.ffn.2.weight": [[2, 1, 0], [-1, 2, 1], [0, -1, 2]],
        "blocks.0.norm_wkv.weight": [1, Q(3, 2), 1], "blocks.0.norm_wkv.bias": [0, Q(1, 4), Q(-1, 4)],
        "blocks.0.norm_ffn.weight": [2, 1, 1], "blocks.0.norm_ffn.bias": [Q(1, 2), 0, 0]}
HAND_TOKENS = [2, 0, 1, 1, 0]


def fwkv_by_hand(tokens):
    """FwkvSession::forward_tokens (single-token path) and fwkv_layer_norm,
    fwkv_gelu, act_sigmoid of shared/spec/runtime.cpp.txt, line by line in
    exact rationals. Returns the state and the logits after every token."""
    w = {k: [[Q(x) for x in row] for row in v] if isinstance(v[0], list) else [Q(x) for x in v]
         for k, v in HAND.items()}
    floor, clamp, residual, eps = E.f32(0.1), E.f32(0.999), E.f32(0.1), E.f32(1e-5)   # wkv_floor, 0.999f, 0.1f, 1e-5f

    def matvec(m, x):                        # Matrix::gemm: y_i = sum_j m_ij x_j
        return [sum(mij * xj for mij, xj in zip(row, x)) for row in m]

    def sigmoid(z):
        return 1 / (1 + E.exp(-z))

    def gelu(z):                             # fwkv_gelu: 0.5 x (1 + erf(x / sqrt 2))
        return z / 2 * (1 + E.erf(z / E.sqrt(2)))

    def layer_norm(u, g, b):                 # fwkv_layer_norm: population variance, eps 1e-5f
        mean = sum(u) / len(u)
        var = sum((ui - mean) ** 2 for ui in u) / len(u)
        inv = 1 / E.sqrt(var + eps)
        return [(ui - mean) * inv * gi + bi for ui, gi, bi in zip(u, g, b)]

    p = "blocks.0."
    P, emb = w["shared.proj.weight"], w["shared.weight"]
    decay = [min(max(sigmoid(z), floor), clamp) for z in w[p + "w"]]     # std::clamp(sigmoid(w), floor, 0.999f)
    assert decay == [floor, clamp, Q(1, 2)]
    s, out = [Q(0)] * 3, []
    for token in tokens:
        x = matvec(P, emb[token])                                         # x = P e
        k, v = matvec(w[p + "proj_k.weight"], x), matvec(w[p + "proj_v.weight"], x)
        r = [sigmoid(z) for z in matvec(w[p + "proj_r.weight"], x)]
        s = [ki * vi + di * si for ki, vi, di, si in zip(k, v, decay, s)]  # s = k v + W s
        g = [ri * si for ri, si in zip(r, s)]                              # g = r s
        o = matvec(w[p + "proj_out.weight"], g)
        x = layer_norm([xi + residual * oi for xi, oi in zip(x, o)], w[p + "norm_wkv.weight"], w[p + "norm_wkv.bias"])
        o = matvec(w[p + "ffn.2.weight"], [gelu(z) for z in matvec(w[p + "ffn.0.weight"], x)])
        x = layer_norm([xi + residual * oi for xi, oi in zip(x, o)], w[p + "norm_ffn.weight"], w[p + "norm_ffn.bias"])
        h = layer_norm(x, w["norm.weight"], w["norm.bias"])
        x_emb = [sum(P[i][j] * h[i] for i in range(3)) for j in range(2)]   # x_emb = P^T h
        out.append((list(s), matvec(emb, x_emb)))                          # logits = E x_emb
    return out


def test_tiny_model_by_hand_in_exact_rationals():
    """The engine (fp32, its block prefill and single-token decode) and the
    NumPy reference against the spec's equations evaluated in exact rationals
    (fwkv_by_hand), state and logits after each of five tokens.

    Tolerance: float32 rounding, relative to the largest exact value of each
    vector. The engine: 3e-7 (measured 2026-12-07: state 4.8e-8, logits
    6.9e-8; one float32 rounding is 6e-8). The float64 reference: 3e-8
    (measured 7.1e-9), not ~1e-15, because it writes the spec's float32
    constants 0.1f, 0.999f and the floor as decimals, 1e-9 away.
    """
    want = fwkv_by_hand(HAND_TOKENS)
    want_states = E.to_f64([st for st, _ in want])
    want_logits = E.to_f64([lg for _, lg in want])
    assert np.abs(np.diff(want_states, axis=0)).max(axis=1).min() > 0.1   # the state moves every step
    assert np.abs(want_logits[3] - want_logits[2]).max() > 0.1              # same token, another state
    c = Config(d_model=3, d_emb=2, layers=1, vocab=3, ffn_mult=1, context=16)
    w32 = {k: E.to_f64(v).astype(np.float32) for k, v in HAND.items()}
    assert all(np.array_equal(w32[k], E.to_f64(v)) for k, v in HAND.items())    # exact in float32
    m = Model(c, w32, "fp32", threads=1)

    def close(got, exact, rel):
        scale = np.abs(exact).max(axis=-1, keepdims=True)
        return (np.abs(np.asarray(got, np.float64) - exact) <= rel * scale).all()

    assert close(m.logits_all(HAND_TOKENS), want_logits, 3e-7)
    for n in range(1, len(HAND_TOKENS) + 1):
        s = m.create_session(HAND_TOKENS[:n], 1)
        s.prefill()
        assert close(s.state[0], want_states[n - 1], 3e-7), n
        assert close(s.last_logits, want_logits[n - 1], 3e-7), n
    decoded = m.create_session(HAND_TOKENS[:1], 4)                        # single-token decode steps
    seq = HAND_TOKENS[:1] + decoded.next_tokens(4)
    by_hand = fwkv_by_hand(seq)
    for n in range(1, len(seq)):                                            # greedy: the exact argmax
        z = sorted(float(v) for v in by_hand[n - 1][1])
        assert seq[n] == int(np.argmax(E.to_f64(by_hand[n - 1][1]))) and z[-1] - z[-2] > 1e-3, n
    n = decoded.position
    assert close(decoded.state[0], E.to_f64(by_hand[n - 1][0]), 3e-7), n
    assert close(decoded.last_logits, E.to_f64(by_hand[n - 1][1]), 3e-7), n
    rc = ref.make_config(d_model=3, d_emb=2, layers=1, vocab=3, ffn_mult=1, context=16, wkv_floor=0.1)
    state = ref.init_state(rc)
    for n, token in enumerate(HAND_TOKENS):
        z = ref.step(rc, {k: E.to_f64(v) for k, v in HAND.items()}, state, token)
        assert close(state[0], want_states[n], 3e-8) and close(z, want_logits[n], 3e-8), n


def test_half_precision_checkpoint_loads(tmp_path):
    """bf16/fp16 tensors widen exactly: the model equals one built from the widened arrays."""
    import safetensors.torch
    import torch
    c = config()
    w = weights(c, 3)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(c.to_hf()))
    half = {k: torch.from_numpy(v).to(torch.bfloat16 if i % 2 else torch.float16)
            for i, (k, v) in enumerate(sorted(w.items()))}
    safetensors.torch.save_file(half, str(d / "model.safetensors"))
    widened = {k: t.to(torch.float32).numpy() for k, t in half.items()}
    tokens = [5, 9, 1, 44, 96, 0]
    assert np.array_equal(Model.from_pretrained(d, threads=1).logits_all(tokens),
                          Model(c, widened, threads=1).logits_all(tokens))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_matches_reference_on_its_stored_weights(precision):
    """Each storage is exact up to its own rounding: the reference run on the
    dequantized matrices agrees to 1e-4. int8 activations add a quantization
    step per row: their logits stay close to the fp32-activation ones."""
    c = config(d_model=64, d_emb=24, vocab=101)
    w = weights(c, 5)
    m = Model(c, w, precision, threads=2)
    seen = dict(w)
    for name in ["shared.weight"] + [f"blocks.{i}.{n}" for i in range(c.layers) for n in MATRICES]:
        seen[name] = m.matrix(name).dequantize()
    tokens = list(np.random.default_rng(2).integers(0, c.vocab, 30))
    want = ref.logits(ref_config(c), seen, tokens)
    got = m.logits_all(tokens)
    assert rel_err(got, want) < 1e-4
    m.set_act_precision("int8")
    q8 = m.logits_all(tokens)
    assert np.isfinite(q8).all()
    if precision in ("fp32", "fp16"):
        assert np.array_equal(q8, got)  # float storages ignore act_precision
    else:
        assert rel_err(q8, got) < 0.1
        assert np.mean(q8.argmax(-1) == got.argmax(-1)) >= 0.8


# ------------------------------------------------------------- invariances ---

@pytest.mark.parametrize("precision,act", [(p, "fp32") for p in PRECISIONS]
                         + [("int8", "int8"), ("hybrid-int4", "int8"), ("int4", "int8"), ("fp4", "int8")])
def test_block_equals_single_steps(precision, act):
    """Logits and state after each single-token decode step equal, bit for
    bit, those of running the same tokens as one block; blocks of any length
    and the 256-token prefill chunking agree too."""
    m = model(precision, act_precision=act, seed=1)
    prompt = list(np.random.default_rng(2).integers(0, 97, 250))
    s = m.create_session(prompt, 12)
    assert s.last_logits is None
    generated, last = [], []
    for _ in range(12):
        generated += s.next_tokens(1)
        last.append(s.last_logits)
    assert len(generated) == 12 and s.finish_reason == "length"
    seq = prompt + generated
    rows = m.logits_all(seq)                 # chunks of 256 and 6
    for i in range(11):                      # step i ran generated[i] alone
        assert np.array_equal(last[i], rows[len(prompt) + i]), i
    assert np.array_equal(last[11], last[10])  # a finished session never runs its last token
    for n in (1, 2, 17, 100, 256, 257):
        assert np.array_equal(m.logits(seq[:n]), rows[n - 1]), n
    p = m.create_session(seq[:-1], 1)
    p._prefill_now()
    assert np.array_equal(p.state, s.state) and np.array_equal(p.last_logits, s.last_logits)
    assert p.history == s.history == seq[:-1] and p.position == s.position == len(seq) - 1


@pytest.mark.parametrize("precision", ["fp32", "int8", "hybrid-fp4", "int4", "fp4"])
def test_thread_count_does_not_change_results(precision):
    c = config(d_model=96, d_emb=40, vocab=131)
    w = weights(c, 7)
    tokens = list(np.random.default_rng(3).integers(0, c.vocab, 70))
    base = Model(c, w, precision, threads=1)
    want = base.logits_all(tokens)
    gen = base.create_session(tokens[:9], 16).next_tokens(16)
    for threads in (2, 3):
        m = Model(c, w, precision, threads=threads)
        assert np.array_equal(m.logits_all(tokens), want)
        assert m.create_session(tokens[:9], 16).next_tokens(16) == gen


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_isa_gives_the_same_bits(precision, isa_level):
    m = model(precision, seed=2, d_model=72, d_emb=36)
    tokens = list(np.random.default_rng(5).integers(0, 97, 20))
    isa_level("ref")
    want = m.logits_all(tokens)
    for isa in runnable_isas()[1:]:
        isa_level(isa)
        assert np.array_equal(m.logits_all(tokens), want), isa


# --------------------------------------------------------- speculation ---

def _same_session(a, b):
    assert a.history == b.history and a.position == b.position
    assert a.generated_tokens == b.generated_tokens and a.finish_reason == b.finish_reason
    assert np.array_equal(a.state, b.state)
    assert np.array_equal(a.last_logits, b.last_logits)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_speculative_equals_greedy(precision):
    m = model(precision, seed=6, d_model=64, d_emb=24)
    prompt = repetitive_prompt(97)
    plain = m.create_session(prompt, 60)
    want = plain.next_tokens(60)
    rejects = 0
    for k in (2, 4, 8, 16):
        s = m.create_session(prompt, 60)
        assert s.next_tokens(60, spec_k=k) == want, k
        proposed, accepted = s.spec_stats()
        assert proposed > 0 and 0 < accepted <= proposed
        rejects += proposed - accepted
        _same_session(s, plain)
    assert rejects > 0  # partial rejects happened
    # split calls: after every call the state is exactly plain decoding's
    s, p = m.create_session(prompt, 60), m.create_session(prompt, 60)
    got = []
    for n in (1, 2, 5, 3, 9, 60):
        got += s.next_tokens(n, spec_k=4)
        p.next_tokens(n)
        _same_session(s, p)
    assert got == want
    # eos inside a verification block: stop there, state as plain decoding's
    eos = next(t for t in want[6:] if want.index(t) >= 6)
    s, p = m.create_session(prompt, 60, eos=[eos]), m.create_session(prompt, 60, eos=[eos])
    assert s.next_tokens(60, spec_k=8) == p.next_tokens(60) == want[: want.index(eos) + 1]
    assert s.finish_reason == "stop" and s.spec_stats()[1] > 0
    _same_session(s, p)
    # eos on an accepted candidate in the middle of a block: the state rewinds
    # to just before it, where plain decoding stops
    i = next(i for i in range(2, 50) if want[i] not in want[:i])
    s, p = m.create_session(prompt, 60, eos=[want[i]]), m.create_session(prompt, 60, eos=[want[i]])
    assert s.next_tokens(i - 1) == want[:i - 1]
    assert s.verify(want[i - 1:i + 4]) == want[i - 1:i + 1] and s.finish_reason == "stop"
    assert p.next_tokens(60) == want[:i + 1]
    _same_session(s, p)
    # budget edges
    for budget in (1, 2, 3, 9, 17):
        s, p = m.create_session(prompt, budget), m.create_session(prompt, budget)
        assert s.next_tokens(100, spec_k=8) == p.next_tokens(100) == want[:budget]
        assert s.finish_reason == "length"
        _same_session(s, p)


def test_verify_and_draft():
    m = model(seed=6, d_model=64, d_emb=24)
    prompt = repetitive_prompt(97)
    want = m.create_session(prompt, 30).next_tokens(30)
    s = m.create_session(prompt, 30)
    assert s.draft(3) == []  # nothing absorbed before the prompt runs
    s.next_tokens(1)
    from cism.sampling import draft
    assert s.draft(4) == draft(prompt + want[:1], 4)
    # a right guess is accepted with a bonus token
    out = s.verify(want[1:5])
    assert out == want[1:len(out) + 1] and len(out) == 5
    # a right head with a wrong tail: partial reject, the state rewinds
    n = 1 + len(out)
    wrong = [want[n], want[n + 1], (want[n + 2] + 1) % 97, 5, 6]
    out2 = s.verify(wrong)
    assert out2 == want[n:n + 3]
    p = m.create_session(prompt, 30)
    p.next_tokens(n + 3)
    _same_session(s, p)
    # a wrong head costs nothing
    n += 3
    assert s.verify([(want[n] + 1) % 97, 0]) == [want[n]]
    assert s.next_tokens(30) == want[n + 1:]
    with pytest.raises(ValueError, match="at most 16"):
        s.verify(list(range(17)))
    with pytest.raises(ValueError, match="greedy"):
        m.create_session(prompt, 5, temperature=1.0).verify([1, 2])
    assert s.verify([1, 2]) == []  # finished


# ---------------------------------------------------------------- sampling ---

def test_sampling_is_reproducible_and_degenerates_to_greedy():
    m = model(seed=6)
    prompt = [5, 9, 13]
    greedy = m.create_session(prompt, 30).next_tokens(30)
    kw = dict(temperature=0.9, top_p=0.95, top_k=20)
    a = m.create_session(prompt, 30, seed=11, **kw).next_tokens(30)
    assert a == m.create_session(prompt, 30, seed=11, **kw).next_tokens(30)
    assert a != m.create_session(prompt, 30, seed=12, **kw).next_tokens(30)
    assert m.create_session(prompt, 30, temperature=1.5, top_k=1, seed=3).next_tokens(30) == greedy
    s = m.create_session(prompt, 30, seed=11, **kw)
    assert s.next_tokens(7) + s.next_tokens(23) == a


def test_eos_and_length():
    m = model(seed=7)
    want = m.create_session([1, 2], 20).next_tokens(20)
    s = m.create_session([1, 2], 20, eos=[want[4]])
    assert s.next_tokens(100) == want[: want.index(want[4]) + 1]
    assert s.finish_reason == "stop" and s.next_tokens(5) == []
    s = m.create_session([1, 2], 6)
    assert s.finish_reason == ""
    assert s.next_tokens(100) == want[:6] and s.finish_reason == "length"
    assert s.generated_tokens == 6 and s.capacity == 8 and s.position == 7
    z = m.create_session([1, 2], 0)
    assert z.finish_reason == "length" and z.next_tokens(3) == []


# ------------------------------------------------------------ cancellation ---

def test_cancel_before_and_during_decode_and_prefill():
    m = model(seed=8, d_model=256, d_emb=64, layers=4, ffn_mult=4, vocab=500, context=8192)
    before = m.create_session([1, 2, 3], 5).next_tokens(5), m.logits(list(range(1, 40)))
    s = m.create_session([1, 2, 3], 10)
    s.cancel()
    assert s.next_tokens(5) == [] and s.finish_reason == "cancelled"
    assert s.verify([1, 2]) == []

    out = {}
    s = m.create_session([1, 2, 3], 5000)
    t = threading.Thread(target=lambda: out.setdefault("decode", s.next_tokens(5000)))
    t.start()
    time.sleep(0.2)
    s.cancel()
    t.join()
    assert s.finish_reason == "cancelled" and len(out["decode"]) < 5000
    assert s.next_tokens(3) == []

    prompt = list(np.random.default_rng(0).integers(0, 500, 8000))
    s = m.create_session(prompt, 10)
    t = threading.Thread(target=lambda: out.setdefault("prefill", s.next_tokens(10)))
    t.start()
    time.sleep(0.05)
    s.cancel()
    t.join()
    assert s.finish_reason == "cancelled" and out["prefill"] == []
    # the model is untouched: what it gave before the cancels, bit for bit
    assert m.create_session([1, 2, 3], 5).next_tokens(5) == before[0]
    assert np.array_equal(m.logits(list(range(1, 40))), before[1])


# -------------------------------------------------------------------- text ---

def test_gpt2_tokenizer_round_trip_through_a_random_model(data_dir):
    tok_dir = data_dir / "tokenizers" / "gpt2"
    tok = cism.Tokenizer.from_gpt2_files(tok_dir / "encoder.json", tok_dir / "vocab.bpe")
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 50257
    c = Config(d_model=32, d_emb=16, layers=1, vocab=50257, ffn_mult=2)
    m = Model(c, weights(c, 9), "int8", threads=2)
    out = m.create_session(ids, 8).next_tokens(8)
    assert len(out) == 8 and all(0 <= t < 50257 for t in out)
    assert isinstance(tok.decode(out), str) and tok.decode(ids + out).startswith(text)


# --------------------------------------------------------------- validation ---

def test_config_validation_messages():
    ok = dict(d_model=8, d_emb=4, layers=1, vocab=5)
    c = Config(**ok)
    assert (c.ffn_mult, c.context, c.wkv_floor, c.tied, c.model_type) == (4, 1024, np.float32(0.1), True, "fwkv")
    cases = [
        (dict(model_type="llama"), "model_type must be fwkv for FWKV models"),
        (dict(d_model=0), "d_model is outside supported bounds"),
        (dict(d_model=8193), "d_model is outside supported bounds"),
        (dict(d_emb=2049), "d_emb is outside supported bounds"),
        (dict(layers=129), "n_layers is outside supported bounds"),
        (dict(layers=0), "n_layers is outside supported bounds"),
        (dict(ffn_mult=17), "ffn_mult is outside supported bounds"),
        (dict(ffn_mult=0), "ffn_mult is outside supported bounds"),
        (dict(vocab=2_000_001), "vocab_size is outside supported bounds"),
        (dict(context=1_048_577), "max_position_embeddings is outside supported bounds"),
        (dict(wkv_floor=1.0), r"wkv_floor must be in \[0, 1\)"),
        (dict(wkv_floor=0.99999999), r"wkv_floor must be in \[0, 1\)"),   # 1.0 in float32
        (dict(wkv_floor=-0.01), r"wkv_floor must be in \[0, 1\)"),
        (dict(wkv_floor=float("nan")), r"wkv_floor must be in \[0, 1\)"),
        (dict(wkv_floor="0.1"), "wkv_floor must be a number"),
        (dict(tied=False), r"FWKV requires tie_word_embeddings=true \(factorized tied head\)"),
        (dict(tied=1), "tie_word_embeddings must be true or false"),
        (dict(d_model=8.0), "d_model must be an integer"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            Config(**{**ok, **change})
    Config(**{**ok, "d_model": 8192, "d_emb": 2048, "layers": 128, "ffn_mult": 16,
              "context": 1_048_576, "wkv_floor": 0.0})


def test_from_hf_mapping_and_refusals():
    d = dict(model_type="fwkv", d_model=768, d_emb=192, n_layers=13, vocab_size=50257)
    assert Config.from_hf(d) == Config(d_model=768, d_emb=192, layers=13, vocab=50257)
    full = {**d, "ffn_mult": 2, "max_position_embeddings": 4096, "wkv_floor": 0.25,
            "tie_word_embeddings": True}
    c = Config.from_hf(full)
    assert (c.ffn_mult, c.context, c.wkv_floor) == (2, 4096, 0.25)
    assert Config.from_hf(c.to_hf()) == c
    for key in ("d_model", "d_emb", "n_layers", "vocab_size"):
        with pytest.raises(ValueError, match=f"missing '{key}'"):
            Config.from_hf({k: v for k, v in d.items() if k != key})
    with pytest.raises(ValueError, match="model_type must be fwkv"):
        Config.from_hf({**d, "model_type": "rwkv"})
    with pytest.raises(ValueError, match="tie_word_embeddings=true"):
        Config.from_hf({**d, "tie_word_embeddings": False})
    with pytest.raises(ValueError, match="config must be a dict"):
        Config.from_hf([1])


def test_weight_validation_messages():
    c = config()
    good = weights(c)
    Model(c, good, threads=1)
    assert set(weight_shapes(c)) == set(good)
    bad = dict(good)
    del bad["blocks.1.norm_ffn.bias"]
    with pytest.raises(ValueError, match="unexpected or missing weights: missing blocks.1.norm_ffn.bias"):
        Model(c, bad)
    with pytest.raises(ValueError, match="unexpected lm_head.weight"):
        Model(c, dict(good, **{"lm_head.weight": good["shared.weight"]}))
    bad = dict(good, **{"blocks.0.ffn.0.weight": np.zeros((95, 48), np.float32)})
    with pytest.raises(ValueError, match=r"incorrectly sized weight: blocks.0.ffn.0.weight \(expected shape \(96, 48\)"):
        Model(c, bad)
    bad = dict(good, **{"shared.proj.weight": good["shared.proj.weight"].T.copy()})
    with pytest.raises(ValueError, match="incorrectly sized weight: shared.proj.weight"):
        Model(c, bad)
    for name in ("blocks.0.proj_r.weight", "blocks.1.w", "norm.bias", "shared.weight"):
        bad = dict(good, **{name: good[name].copy()})
        bad[name].flat[3] = np.nan
        with pytest.raises(ValueError, match=f"non-finite weight: {name}"):
            Model(c, bad)
    with pytest.raises(ValueError, match="must be a float array"):
        Model(c, dict(good, **{"norm.weight": np.arange(48)}))
    with pytest.raises(ValueError, match="precision must be"):
        Model(c, good, precision="int2")
    with pytest.raises(ValueError, match="act_precision must be"):
        Model(c, good, act_precision="fp16")
    with pytest.raises(ValueError, match="threads must be in"):
        Model(c, good, threads=0)
    with pytest.raises(ValueError, match="config must be a cism.fwkv.Config"):
        Model({"d_model": 8}, good)
    with pytest.raises(ValueError, match="weights must be a mapping"):
        Model(c, [1, 2])
    huge = Config(d_model=8192, d_emb=2048, layers=128, vocab=2_000_000, ffn_mult=16)
    with pytest.raises(ValueError, match="64 GiB safety limit"):
        weight_shapes(huge)


def test_malformed_checkpoints_name_the_tensor(tmp_path):
    c = config()
    good = weights(c)
    broken = {
        "missing": ({k: v for k, v in good.items() if k != "blocks.0.proj_k.weight"},
                    "missing blocks.0.proj_k.weight"),
        "shape": (dict(good, **{"blocks.1.ffn.2.weight": np.zeros((48, 95), np.float32)}),
                  "incorrectly sized weight: blocks.1.ffn.2.weight"),
        "nan": (dict(good, **{"blocks.0.norm_wkv.weight": np.full(48, np.nan, np.float32)}),
                "non-finite weight: blocks.0.norm_wkv.weight"),
    }
    for name, (w, message) in broken.items():
        d = save_dir(tmp_path / name, c, w)
        with pytest.raises(ValueError, match=message):
            Model.from_pretrained(d)
    d = save_dir(tmp_path / "cfg", c, good)
    (d / "config.json").write_text(json.dumps({**c.to_hf(), "d_emb": 0}))
    with pytest.raises(ValueError, match="d_emb is outside supported bounds"):
        cism.load(d)


def test_session_validation_messages():
    m = model(context=64)
    ok = dict(prompt=[1, 2], max_new_tokens=4)
    cases = [
        (dict(prompt=[]), "at least one token"),
        (dict(prompt=[1, 97]), "outside the vocabulary"),
        (dict(prompt=[-1]), "outside the vocabulary"),
        (dict(prompt="hello"), "not text"),
        (dict(prompt=[1.5, 2.0]), "integer token ids"),
        (dict(max_new_tokens=-1), "max_new_tokens must be a nonnegative integer"),
        (dict(max_new_tokens=63), "exceeds max_position_embeddings"),
        (dict(temperature=-0.1), "temperature must be finite and nonnegative"),
        (dict(temperature=float("nan")), "temperature must be finite and nonnegative"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
        (dict(top_k=98), r"top_k must be in \[0, vocab_size=97\]"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(eos=[97]), "outside the vocabulary"),
    ]
    for change, message in cases:
        args = {**ok, **change}
        with pytest.raises(ValueError, match=message):
            m.create_session(args.pop("prompt"), args.pop("max_new_tokens"), **args)
    m.create_session([1, 2], 62)  # exactly the context
    s = m.create_session([1, 2], 4)
    with pytest.raises(ValueError, match="count must be a nonnegative integer"):
        s.next_tokens(-1)
    for k in (1, 17, -2):
        with pytest.raises(ValueError, match=r"spec_k must be 0 \(off\) or in \[2, 16\]"):
            s.next_tokens(2, spec_k=k)
    with pytest.raises(ValueError, match="greedy"):
        m.create_session([1], 4, temperature=0.5).next_tokens(2, spec_k=4)
    with pytest.raises(ValueError, match="candidates"):
        s.verify([1, 200])
    with pytest.raises(ValueError, match="nll requires at least 2 tokens"):
        m.nll([1])


def test_model_properties_and_memory_controls():
    c = config()
    w = weights(c)
    m = Model(c, w, "hybrid-int4", threads=2, act_precision="int8")
    assert (m.precision, m.act_precision, m.thread_count) == ("hybrid-int4", "int8", 2)
    assert m.matrix("blocks.0.ffn.0.weight").storage == "int4"
    assert m.matrix("blocks.1.proj_out.weight").storage == "int8"
    assert m.matrix("shared.weight").storage == "int8"
    with pytest.raises(ValueError, match="no matrix named"):
        m.matrix("shared.proj.weight")   # stays fp32, used with double sums
    mats = ["shared.weight"] + [f"blocks.{i}.{n}" for i in range(c.layers) for n in MATRICES]
    vectors = [n for n in w if n not in mats]
    assert m.weight_bytes == sum(m.matrix(n).nbytes for n in mats) + 4 * sum(w[n].size for n in vectors)
    assert Model(c, w, "fp32", threads=1).weight_bytes == 4 * sum(v.size for v in w.values())
    key = m.compile_key
    assert len(key) == 32 and key == Model(c, w, "hybrid-int4", threads=2, act_precision="int8").compile_key
    m.set_act_precision("fp32")
    assert m.compile_key != key and m.act_precision == "fp32"
    assert m.compile_canonical == "fwkv|48|20|2|2|97|512|0x1.99999ap-4|1"   # C's %a of 0.1f
    assert m.scan() == m.touch() > 0
    check_lock_pages(m)
    assert "fwkv" in repr(m)


@pytest.mark.parametrize("precision", ["int4", "fp4"])
def test_all_4bit_precisions_store_every_matrix_at_4_bits(precision):
    """int4/fp4: the WKV projections, the FFN and the shared embedding/head
    at 4 bits; shared.proj stays fp32 as in every precision."""
    c = config()
    m = Model(c, weights(c), precision, threads=1)
    for name in ["shared.weight"] + [f"blocks.{i}.{n}" for i in range(c.layers) for n in MATRICES]:
        assert m.matrix(name).storage == precision, name
