"""Dense Llama/Qwen3: parity with transformers, invariances (threads, chunking,
speculation), sampling, cancellation, and every validation message."""
import threading
import time

import numpy as np
import pytest

from cism.dense import Config, Model, weight_shapes

from memlock import check_lock_pages
from models import dense_weights, small_config, small_model

PRECISIONS = ["fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"]


# ------------------------------------------------------ transformers parity ---

def hf_model(kind, seed, **kw):
    """A random transformers model of `kind` (the oracle) and its config dict;
    skips the calling test where torch or transformers is not installed."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    common = dict(vocab_size=kw.get("vocab", 301), hidden_size=kw.get("hidden", 128),
                  intermediate_size=kw.get("inter", 200), num_hidden_layers=kw.get("layers", 2),
                  num_attention_heads=kw.get("heads", 4), num_key_value_heads=kw.get("kv", 2),
                  max_position_embeddings=256, tie_word_embeddings=kw.get("tied", False),
                  initializer_range=0.1, rope_theta=kw.get("theta", 10000.0))
    if kind == "llama":
        cfg = transformers.LlamaConfig(rms_norm_eps=1e-5, head_dim=kw.get("head_dim"),
                                       rope_scaling=kw.get("rope_scaling"), **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(rms_norm_eps=1e-5, head_dim=kw.get("head_dim"),
                                         sliding_window=kw.get("window"), **common)
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(rms_norm_eps=1e-6, rope_scaling=kw.get("rope_scaling"), **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(rms_norm_eps=1e-6, head_dim=kw.get("head_dim", 64),
                                       rope_scaling=kw.get("rope_scaling"), **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # lively norms so tokens are not one repeated id
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.eval()
    cfg_dict = cfg.to_dict()
    cfg_dict["model_type"] = kind
    return cfg_dict, model


# YaRN with an original context (16, 32) shorter than the prompt and its
# generation (45 positions), so the ramp puts frequencies in all three bands
# (kept, blended, divided): Qwen2.5's form (the old "type" key, transformers'
# defaults), every explicit key, and DeepSeek's mscale pair without truncation
YARN_CASES = [
    ("qwen2", 4, 2, 32, 10000.0, {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}),
    ("llama", 2, 1, 128, 1e6, {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16,
                               "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25}),
    ("qwen3", 2, 2, 64, 1e6, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                              "mscale": 2.0, "mscale_all_dim": 1.0, "truncate": False}),
]

PARITY = [
    ("llama", dict(heads=4, kv=4, tied=True)),                       # MHA, tied
    ("llama", dict(heads=4, kv=2, vocab=317)),                       # GQA, vocab % 32 != 0
    ("llama", dict(heads=2, kv=1, head_dim=128, hidden=128, inter=96, tied=True)),
    ("qwen3", dict(heads=4, kv=2, head_dim=64, vocab=299)),          # q/k norms, width != hidden
    ("qwen3", dict(heads=2, kv=2, head_dim=128, tied=True, layers=3)),
    # Llama 3.x rope scaling: 128-wide heads give frequencies in all three
    # bands of the llama3 rule (kept, divided, blended) for this short
    # original context; linear scaling divides them all
    ("llama", dict(heads=2, kv=1, head_dim=128, hidden=128, theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    ("llama", dict(heads=4, kv=2, rope_scaling={"rope_type": "linear", "factor": 4.0})),
] + [(kind, dict(heads=h, kv=kv, head_dim=hd, hidden=128, theta=theta, rope_scaling=scaling))
     for kind, h, kv, hd, theta, scaling in YARN_CASES] + [
    ("qwen2", dict(heads=4, kv=2, vocab=305)),                       # q/k/v biases
    ("qwen2", dict(heads=4, kv=1, tied=True)),
    # a sliding window shorter than the prompt (13) and the generation (45)
    ("mistral", dict(heads=4, kv=2, window=8)),
    ("mistral", dict(heads=4, kv=4, window=1, tied=True)),
    ("mistral", dict(heads=4, kv=2, window=None)),
]


@pytest.mark.parametrize("kind,kw", PARITY)
def test_parity_with_transformers(kind, kw, tmp_path):
    cfg_dict, hf = hf_model(kind, seed=len(str(kw)), **kw)
    import torch
    if kind == "qwen2":   # random biases (transformers starts them at zero)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("proj.bias"):
                    p.copy_(0.5 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = Model.from_pretrained(tmp_path, threads=2)
    assert model.config == Config.from_hf(cfg_dict)
    assert model.config.sliding_window == (kw.get("window") or 0)
    assert bool(model.config.rope_scaling) == ("rope_scaling" in kw)
    prompt = [3, 17, 42, 99, 5, 7, 250, 1, 0, 280, 12, 12, 12]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
        # windows without transformers' KV cache: at window=1 its cached
        # generate disagrees with its own uncached forward
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          use_cache=kind != "mistral")[0, len(prompt):].tolist()
    got = model.logits(prompt)
    assert np.abs(got - want[-1]).max() / np.abs(want[-1]).max() < 1e-4
    assert model.create_session(prompt, 32).next_tokens(32) == gen
    # teacher-forced NLL from transformers' logits of every position
    logp = torch.log_softmax(torch.tensor(want, dtype=torch.float64), -1).numpy()
    nll = -np.mean([logp[i, prompt[i + 1]] for i in range(len(prompt) - 1)])
    assert abs(model.nll(prompt) - nll) < 1e-4 * max(1, abs(nll))


# ------------------------------------------------------------- invariances ---

@pytest.mark.parametrize("precision", PRECISIONS)
def test_thread_count_does_not_change_logits(precision):
    config = small_config("qwen3")
    w = dense_weights(config, 1)
    prompt = list(range(3, 60))
    base = Model(config, w, precision, threads=1).logits(prompt)
    for threads in (2, 3):
        assert np.array_equal(Model(config, w, precision, threads=threads).logits(prompt), base)


@pytest.mark.parametrize("precision,heads,kv_heads,kv,head_dim", [
    ("fp32", 4, 2, "fp32", 16), ("int8", 4, 2, "fp32", 16), ("hybrid-fp4", 4, 2, "fp32", 16),
    ("int4", 4, 2, "fp32", 16), ("fp4", 4, 2, "fp16", 16),
    ("fp32", 4, 4, "fp32", 16), ("fp32", 6, 2, "fp32", 16), ("int8", 12, 2, "fp32", 16),
    ("int8", 4, 2, "fp16", 16), ("fp32", 12, 2, "fp16", 16), ("fp32", 6, 2, "fp32", 48),
    ("fp32", 18, 1, "fp32", 16)])
def test_decode_steps_equal_blocked_prefill(precision, heads, kv_heads, kv, head_dim):
    """Logits after each single-token decode step equal, bit for bit, the
    logits of prefilling the same tokens as one blocked prompt (chunks of 256,
    whose boundary the sequence crosses). Decode attends with the heads of
    a KV group as one tile (up to 16 at a time; at one thread, or with two
    groups per thread), from 256 positions on at two threads in phases
    (attend_split: key tiles and value columns of 32 spread over the
    threads), prefill head by head in query tiles of up to 16: group sizes
    1, 2, 3, 6 and 18 (a tile of 16 heads and one of 2), heads of 16 and 48
    values (a whole and a partial column run)."""
    for threads in (1, 2):
        model = small_model("llama", precision, threads=threads, context=1024, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim, kv_precision=kv)
        prompt = list(np.random.default_rng(2).integers(0, 97, 250))
        s = model.create_session(prompt, 12)
        assert s.last_logits is None
        s.next_tokens(0)
        generated = []
        for _ in range(12):
            generated += s.next_tokens(1)
            if s.finish_reason:
                break
            assert np.array_equal(s.last_logits, model.logits(prompt + generated)), threads
        assert len(generated) == 12

@pytest.mark.parametrize("window", [1, 16, 40, 200])
def test_sliding_window_decode_equals_blocked_prefill(window):
    """A Mistral window, every attention path: prompt tiles that the window
    cuts into (a query tile's own starts), lone decode tokens (the group as
    one tile) and, from 256 positions at two threads, attend_split, whose
    key tiles then start at the window's. Each step's logits equal blocked
    prefill's; and the window changes them (against window 0)."""
    for threads in (1, 2):
        model = small_model("mistral", threads=threads, context=1024, sliding_window=window)
        prompt = list(np.random.default_rng(5).integers(0, 97, 250))
        s = model.create_session(prompt, 12)
        s.next_tokens(0)
        generated = []
        for _ in range(11):
            generated += s.next_tokens(1)
            assert np.array_equal(s.last_logits, model.logits(prompt + generated)), (window, threads)
    full = small_model("mistral", threads=2, context=1024)
    assert not np.array_equal(full.logits(prompt), model.logits(prompt))


@pytest.mark.parametrize("kind,kw", [
    ("mistral", dict(sliding_window=5)), ("qwen2", dict(qkv_bias=True)),
    ("llama", dict(head_dim=64, heads=2, kv_heads=1, rope_theta=5e5,
                   rope_scaling=("llama3", 8.0, 1.0, 4.0, 32))),
    ("llama", dict(rope_scaling=("linear", 2.5))),
    # yarn: (factor, original context, beta_fast, beta_slow, attention factor, truncate)
    ("qwen2", dict(qkv_bias=True, head_dim=64, heads=2, kv_heads=1, rope_theta=1e6,
                   rope_scaling=("yarn", 4.0, 24, 32.0, 1.0, 1.1386294361, True))),
    ("llama", dict(head_dim=64, heads=2, kv_heads=1, rope_scaling=("yarn", 8.0, 16, 8.0, 0.5, 1.3, False)))])
def test_architectures_follow_the_reference(kind, kw):
    """Each architecture's difference against the NumPy forward of
    tests/reference/dense.py (float64, written from the equations): the
    window's mask, the biases, the scaled rotary frequencies (and YaRN's
    attention factor on cos and sin, over a prompt of 40 past its original
    context)."""
    from reference.dense import forward as ref_forward
    config = small_config(kind, **kw)
    w = dense_weights(config, 3)
    prompt = list(np.random.default_rng(1).integers(0, 97, 40))
    want = ref_forward(config.to_hf(), w, prompt)
    got = Model(config, w, threads=2).logits(prompt)
    assert np.abs(got - want[-1]).max() / np.abs(want[-1]).max() < 1e-4
    plain = small_config("llama", **{k: v for k, v in kw.items() if k in ("head_dim", "heads", "kv_heads",
                                                                           "rope_theta")})
    w_plain = {k: v for k, v in w.items() if not k.endswith(".bias")}
    assert not np.allclose(Model(plain, w_plain, threads=2).logits(prompt), got, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("precision,kv", [(p, "fp32") for p in PRECISIONS] + [("int8", "fp16")])
def test_speculative_equals_greedy(precision, kv):
    model = small_model("llama", precision, seed=3, kv_precision=kv)
    rng = np.random.default_rng(4)
    base = list(rng.integers(0, 97, 12))
    prompt = base + base + base[:5]  # repetitive: the drafter finds matches
    want = model.create_session(prompt, 60, eos=[]).next_tokens(60)
    for k in (2, 4, 8, 16):
        s = model.create_session(prompt, 60)
        got = s.next_tokens(60, spec_k=k)
        assert got == want, k
        proposed, accepted = s.spec_stats()
        assert proposed > 0 and 0 <= accepted <= proposed
    # eos and budget edges inside a verification block
    eos = want[7]
    stop = model.create_session(prompt, 60, eos=[eos])
    assert stop.next_tokens(60, spec_k=8) == want[: want.index(eos) + 1]
    assert stop.finish_reason == "stop"
    for budget in (1, 2, 3, 9):
        s = model.create_session(prompt, budget)
        assert s.next_tokens(100, spec_k=8) == want[:budget]
        assert s.finish_reason == "length"
    s = model.create_session(prompt, 60)
    got = []
    for n in (1, 2, 5, 3, 60):
        got += s.next_tokens(n, spec_k=4)
    assert got == want


def test_verify_and_draft():
    model = small_model("llama", seed=5)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    want = model.create_session(prompt, 20).next_tokens(20)
    s = model.create_session(prompt, 20)
    s.next_tokens(0)
    assert s.draft(3) == []  # nothing cached before the prompt runs
    s.next_tokens(1)
    hist = prompt + want[:1]
    from cism.sampling import draft
    assert s.draft(4) == draft(hist, 4)
    # a right guess is accepted with a bonus token; a wrong one costs nothing
    out = s.verify(want[1:4])
    assert out == want[1:len(out) + 1] and len(out) >= 2
    out2 = s.verify([(want[len(out) + 1] + 1) % 97, 0])
    assert out2 == [want[len(out) + 1]]
    assert s.next_tokens(20) == want[len(out) + 2:]
    with pytest.raises(ValueError, match="at most 16"):
        s.verify(list(range(17)))
    with pytest.raises(ValueError, match="greedy"):
        model.create_session(prompt, 5, temperature=1.0).verify([1, 2])


# ---------------------------------------------------------------- sampling ---

def test_sampling_is_reproducible_and_degenerates_to_greedy():
    model = small_model("qwen3", seed=6)
    prompt = [5, 9, 13]
    greedy = model.create_session(prompt, 30).next_tokens(30)
    a = model.create_session(prompt, 30, temperature=0.9, top_p=0.95, top_k=20, seed=11).next_tokens(30)
    b = model.create_session(prompt, 30, temperature=0.9, top_p=0.95, top_k=20, seed=11).next_tokens(30)
    c = model.create_session(prompt, 30, temperature=0.9, top_p=0.95, top_k=20, seed=12).next_tokens(30)
    assert a == b and a != c
    assert model.create_session(prompt, 30, temperature=1.5, top_k=1, seed=3).next_tokens(30) == greedy
    assert model.create_session(prompt, 30, temperature=1.5, top_p=1e-9, seed=3).next_tokens(30) == greedy
    # split calls draw the same stream
    s = model.create_session(prompt, 30, temperature=0.9, top_p=0.95, top_k=20, seed=11)
    assert s.next_tokens(7) + s.next_tokens(23) == a


def test_eos_and_length():
    model = small_model("llama", seed=7)
    want = model.create_session([1, 2], 20).next_tokens(20)
    s = model.create_session([1, 2], 20, eos=[want[4]])
    assert s.next_tokens(100) == want[: want.index(want[4]) + 1]
    assert s.finish_reason == "stop" and s.next_tokens(5) == []
    s = model.create_session([1, 2], 6)
    assert s.finish_reason == ""
    assert s.next_tokens(100) == want[:6] and s.finish_reason == "length"
    assert s.generated_tokens == 6
    z = model.create_session([1, 2], 0)
    assert z.finish_reason == "length" and z.next_tokens(3) == []


# ------------------------------------------------------------ cancellation ---

def test_cancel_before_and_during_decode_and_prefill():
    model = small_model("llama", seed=8, layers=6, hidden=256, intermediate=512, heads=8, kv_heads=4,
                        head_dim=32, context=4096, vocab=500)
    before = model.create_session([1, 2, 3], 5).next_tokens(5), model.logits(list(range(1, 40)))
    s = model.create_session([1, 2, 3], 10)
    s.cancel()
    assert s.next_tokens(5) == [] and s.finish_reason == "cancelled"

    # mid-decode: a long generation stopped from another thread
    s = model.create_session([1, 2, 3], 3000)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("tokens", s.next_tokens(3000)))
    t.start()
    time.sleep(0.3)
    s.cancel()
    t.join()
    assert s.finish_reason == "cancelled" and len(out["tokens"]) < 3000

    # mid-prefill: a 3500-token prompt cancelled right after it starts
    prompt = list(np.random.default_rng(0).integers(0, 500, 3500))
    s = model.create_session(prompt, 10)
    t = threading.Thread(target=lambda: out.__setitem__("prefill", s.next_tokens(10)))
    t.start()
    time.sleep(0.05)
    s.cancel()
    t.join()
    assert s.finish_reason == "cancelled" and out["prefill"] == []
    # the model is untouched: what it gave before the cancels, bit for bit
    assert model.create_session([1, 2, 3], 5).next_tokens(5) == before[0]
    assert np.array_equal(model.logits(list(range(1, 40))), before[1])


# --------------------------------------------------------------- validation ---

def test_config_validation_messages():
    ok = dict(model_type="llama", hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2,
              head_dim=16, vocab=97, context=64)
    Config(**ok)
    cases = [
        (dict(model_type="gpt2"), "model_type must be one of llama, mistral, qwen2, qwen3"),
        (dict(sliding_window=-3), "sliding_window is outside supported bounds"),
        (dict(qkv_bias=1), "qkv_bias must be true or false"),
        (dict(rope_scaling=("factors", 1.0, 2.0)), "2 factors; head_dim 16 needs 8"),
        (dict(rope_scaling=("factors",) + (0.0,) * 8), "rope_freq_factors must be finite"),
        (dict(rope_scaling=("yarn", 4.0, 16, 32.0, 1.0, 0.0, True)), "rope_scaling yarn must be finite"),
        (dict(rope_scaling=("yarn", 4.0, 16, 32.0, 1.0, 1.1, "yes")), "yarn truncate must be true or false"),
        (dict(rope_scaling=("yarn", 4.0, 16)), r"rope_scaling yarn has \('yarn', 4.0, 16\)"),
        (dict(rope_theta=1.0, rope_scaling=("yarn", 4.0, 16, 32.0, 1.0, 1.1, True)), "rope_theta other than 1"),
        (dict(hidden=0), "hidden_size is outside supported bounds"),
        (dict(hidden=65537), "hidden_size is outside supported bounds"),
        (dict(intermediate=262145), "intermediate_size is outside supported bounds"),
        (dict(layers=257), "num_hidden_layers is outside supported bounds"),
        (dict(heads=513), "num_attention_heads is outside supported bounds"),
        (dict(kv_heads=0), "num_key_value_heads is outside supported bounds"),
        (dict(head_dim=1025), "head_dim is outside supported bounds"),
        (dict(vocab=2_000_001), "vocab_size is outside supported bounds"),
        (dict(context=1_048_577), "max_position_embeddings is outside supported bounds"),
        (dict(kv_heads=3), "attention heads must divide into KV groups"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(heads=512, head_dim=256, kv_heads=1), "query width is outside supported bounds"),
        (dict(eps=0.0), "rms_norm_eps must be finite and positive"),
        (dict(eps=float("nan")), "rms_norm_eps must be finite and positive"),
        (dict(rope_theta=-1.0), "rope_theta must be finite and positive"),
        (dict(hidden=64.0), "hidden_size must be an integer"),
        (dict(tied=1), "tie_word_embeddings must be true or false"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            Config(**{**ok, **change})


def test_from_hf_mapping_and_refusals():
    d = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, vocab_size=97, max_position_embeddings=64)
    c = Config.from_hf(d)
    assert (c.kv_heads, c.head_dim, c.tied, c.rope_theta) == (4, 16, False, 10000.0)
    c = Config.from_hf({**d, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert c.rope_theta == 5e5
    c = Config.from_hf({**d, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert c.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 8192)    # transformers' defaults
    c = Config.from_hf({**d, "rope_parameters": {"rope_type": "linear", "factor": 1.0, "rope_theta": 5e5}})
    assert c.rope_scaling == () and c.rope_theta == 5e5         # linear by 1 is plain RoPE
    c = Config.from_hf({**d, "model_type": "mistral", "sliding_window": 4096})
    assert c.sliding_window == 4096 and Config.from_hf({**d, "sliding_window": 7}).sliding_window == 0
    assert Config.from_hf({**d, "model_type": "qwen2"}).qkv_bias
    # yarn with transformers' defaults: original context = max_position_embeddings,
    # factor = their ratio, betas 32 and 1, attention factor 0.1 ln(factor) + 1
    c = Config.from_hf({**d, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}})
    assert c.rope_scaling == ("yarn", 4.0, 16, 32.0, 1.0, np.float32(0.1 * np.log(4.0) + 1), True)
    c = Config.from_hf({**d, "rope_parameters": {"rope_type": "yarn", "factor": None,
                                                 "original_max_position_embeddings": 16}})
    assert c.rope_scaling[1:3] == (4.0, 16)
    c = Config.from_hf({**d, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert c.rope_scaling[2] == 64
    c = Config.from_hf({**d, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "mscale": 3.0,
                                              "mscale_all_dim": 1.0, "beta_fast": 0}})
    assert c.rope_scaling[3] == 32.0 and c.rope_scaling[5] == np.float32((0.3 * np.log(2) + 1) / (0.1 * np.log(2) + 1))
    assert Config.from_hf(c.to_hf()) == c
    assert Config.from_hf({**d, "rope_scaling": {"rope_type": "yarn", "factor": 1.0}}).rope_scaling == ()
    for extra, message in [({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "'longrope' is not implemented"),
                           ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "not implemented"),
                           ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                              "original_max_position_embeddings": 0}}, "positive integer"),
                           ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "attention_factor": -1.0}},
                            "attention_factor must be finite"),
                           ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}},
                            "truncate must be true or false"),
                           ({"rope_scaling": {"rope_type": "linear"}}, "has no 'factor'"),
                           ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, "factor must be finite"),
                           ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 4.0}},
                            "high_freq_factor > low_freq_factor"),
                           ({"rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": 0}},
                            "positive integer"),
                           ({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                             "rope_parameters": {"rope_type": "linear", "factor": 3.0}}, "disagree"),
                           ({"model_type": "mistral", "sliding_window": -1}, "sliding_window"),
                           ({"model_type": "mistral", "sliding_window": "8"}, "sliding_window must be an integer"),
                           ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
                           ({"attention_bias": True}, "attention_bias"),
                           ({"hidden_act": "gelu"}, "hidden_act"),
                           ({"model_type": "gemma"}, "model_type")]:
        with pytest.raises(ValueError, match=message):
            Config.from_hf({**d, **extra})
    with pytest.raises(ValueError, match="missing 'vocab_size'"):
        Config.from_hf({k: v for k, v in d.items() if k != "vocab_size"})


def test_weight_validation_messages():
    config = small_config()
    good = dense_weights(config)
    Model(config, good, threads=1)
    bad = dict(good)
    del bad["model.norm.weight"]
    with pytest.raises(ValueError, match="unexpected or missing weights: missing model.norm.weight"):
        Model(config, bad)
    bad = dict(good, **{"model.extra": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="unexpected model.extra"):
        Model(config, bad)
    bad = dict(good)
    bad["model.layers.1.mlp.up_proj.weight"] = np.zeros((95, 64), np.float32)
    with pytest.raises(ValueError, match="incorrectly sized weight: model.layers.1.mlp.up_proj.weight"):
        Model(config, bad)
    bad = dict(good)
    bad["model.layers.0.self_attn.q_proj.weight"] = good["model.layers.0.self_attn.q_proj.weight"].copy()
    bad["model.layers.0.self_attn.q_proj.weight"][3, 4] = np.inf
    with pytest.raises(ValueError, match="non-finite weight: model.layers.0.self_attn.q_proj.weight"):
        Model(config, bad)
    bad = dict(good)
    bad["model.norm.weight"] = np.arange(64)
    with pytest.raises(ValueError, match="must be a float array"):
        Model(config, bad)
    tied = small_config(tied=True)
    w = dense_weights(tied, untied_head=True)
    with pytest.raises(ValueError, match="tied lm_head.weight must equal model.embed_tokens.weight"):
        Model(tied, w)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()
    Model(tied, w)  # an equal copy is accepted
    with pytest.raises(ValueError, match="missing lm_head.weight for untied model"):
        Model(config, {k: v for k, v in good.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="precision must be"):
        Model(config, good, precision="int2")
    with pytest.raises(ValueError, match="act_precision must be"):
        Model(config, good, act_precision="fp16")
    with pytest.raises(ValueError, match="threads must be in"):
        Model(config, good, threads=0)
    with pytest.raises(ValueError, match="config must be"):
        Model({"hidden": 1}, good)
    huge = Config("llama", hidden=65536, intermediate=262144, layers=256, heads=512, kv_heads=512,
                  head_dim=128, vocab=2_000_000, context=4096)
    with pytest.raises(ValueError, match="64 GiB safety limit"):
        weight_shapes(huge, True)


def test_session_validation_messages():
    model = small_model(context=64)
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
        (dict(temperature=float("inf")), "temperature must be finite and nonnegative"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
        (dict(top_k=98), r"top_k must be in \[0, vocab_size=97\]"),
        (dict(top_k=-1), "top_k must be in"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(seed=2**64), "seed must be an integer"),
        (dict(eos=[97]), "outside the vocabulary"),
    ]
    for change, message in cases:
        args = {**ok, **change}
        with pytest.raises(ValueError, match=message):
            model.create_session(args.pop("prompt"), args.pop("max_new_tokens"), **args)
    s = model.create_session([1, 2], 4)
    with pytest.raises(ValueError, match="count must be a nonnegative integer"):
        s.next_tokens(-1)
    for k in (1, 17, -2):
        with pytest.raises(ValueError, match=r"spec_k must be 0 \(off\) or in \[2, 16\]"):
            s.next_tokens(2, spec_k=k)
    with pytest.raises(ValueError, match="greedy"):
        model.create_session([1], 4, temperature=0.5).next_tokens(2, spec_k=4)
    with pytest.raises(ValueError, match="nll requires at least 2 tokens"):
        model.nll([1])
    big = Config("llama", hidden=64, intermediate=64, layers=256, heads=4, kv_heads=4, head_dim=16,
                 vocab=10, context=1_048_576)
    bigm = Model(big, dense_weights(big), threads=1)
    with pytest.raises(ValueError, match="8 GiB safety limit"):
        bigm.create_session([1], 500_000)


def test_model_properties_and_memory_controls():
    config = small_config("qwen3")
    w = dense_weights(config)
    m = Model(config, w, "hybrid-int4", threads=2, act_precision="int8")
    assert (m.precision, m.act_precision, m.thread_count) == ("hybrid-int4", "int8", 2)
    assert m.weight_bytes == sum(
        m.matrix(n).nbytes for n in w if n.endswith("proj.weight") or n.endswith("embed_tokens.weight")
        or n == "lm_head.weight") + 4 * sum(v.size for n, v in w.items() if v.ndim == 1)
    assert m.matrix("model.layers.0.mlp.up_proj.weight").storage == "int4"
    assert m.matrix("model.layers.0.self_attn.q_proj.weight").storage == "int8"
    key = m.compile_key
    assert len(key) == 32 and key == Model(config, w, "hybrid-int4", threads=2, act_precision="int8").compile_key
    m.set_act_precision("fp32")
    assert m.compile_key != key and m.act_precision == "fp32"
    assert m.compile_canonical.startswith("qwen3|64|96|2|4|2|16|97|512|")
    assert m.scan() == m.touch() > 0
    assert m.scan(streams=1) == m.scan(streams=16) == m.touch()
    for bad in (0, 17):
        with pytest.raises(ValueError, match="streams must be in"):
            m.scan(streams=bad)
    check_lock_pages(m)


@pytest.mark.parametrize("precision", ["int4", "fp4"])
def test_all_4bit_precisions_store_every_matrix_at_4_bits(precision):
    """int4/fp4: attention, MLP, embedding and head at 4 bits (rows of any
    width: a partial last block is padded, so no shape is refused)."""
    config = small_config("qwen3")
    w = dense_weights(config)
    m = Model(config, w, precision, threads=1)
    for name, v in w.items():
        if v.ndim == 2:
            assert m.matrix(name).storage == precision, name


# ------------------------------------------------------- fp16 KV caches ---

def test_fp16_kv_follows_the_rounded_reference():
    """kv_precision "fp16" stores keys and values rounded to binary16: the
    logits follow the NumPy reference that rounds its cache the same way
    (to within one binary16 rounding of keys that land on the other side
    of a tie) and stand clearly apart from the unrounded reference."""
    from reference import dense as ref
    c = small_config(context=512)
    w = dense_weights(c, seed=5, scale=1.0)
    toks = list(np.random.default_rng(0).integers(0, 97, 200))
    got = Model(c, w, "fp32", kv_precision="fp16").logits_all(toks)
    hf = c.to_hf()

    def rel(a, b):
        return np.abs(a - b).max() / np.abs(b).max()
    near, far = rel(got, ref.logits(hf, w, toks, kv_round=np.float16)), rel(got, ref.logits(hf, w, toks))
    assert near < 5e-4 and far > 10 * near, (near, far)


def test_fp16_kv_halves_the_caches_and_is_part_of_the_model_key():
    c = small_config(context=512)
    w = dense_weights(c)
    m32, m16 = Model(c, w, "int8"), Model(c, w, "int8", kv_precision="fp16")
    assert (m32.kv_precision, m16.kv_precision) == ("fp32", "fp16")
    assert m32.compile_key != m16.compile_key and "kv_precision='fp16'" in repr(m16)
    s32, s16 = m32.create_session([1, 2, 3], 61), m16.create_session([1, 2, 3], 61)
    one = m32.kv_in_use
    assert m16.kv_in_use * 2 == one > 0
    # half the bytes: room for one more fp32 cache is room for two fp16 ones
    for m in (m32, m16):
        m.set_kv_budget(m.kv_in_use + one)
    more = [m16.create_session([1, 2, 3], 61) for _ in range(2)] + [m32.create_session([1, 2, 3], 61)]
    for m in (m32, m16):
        with pytest.raises(ValueError, match="KV budget exceeded"):
            m.create_session([1, 2, 3], 61)
        m.set_kv_budget(None)
    p32, p16 = m32.paged_pool(), m16.paged_pool()
    assert p16.k_pages.dtype == p16.v_pages.dtype == np.float16 and p32.k_pages.dtype == np.float32
    assert p16.kv_bytes() * 2 == p32.kv_bytes()
    del s32, s16, more


def test_kv_precision_is_checked_before_anything_is_read(tmp_path):
    c = small_config()
    for bad in ("bf16", "FP16", None, 16):
        with pytest.raises(ValueError, match="kv_precision must be fp32 or fp16"):
            Model(c, dense_weights(c), kv_precision=bad)
        with pytest.raises(ValueError, match="kv_precision must be fp32 or fp16"):
            Model.from_pretrained(tmp_path / "missing.gguf", kv_precision=bad)


def test_cli_kv_precision(data_dir, tmp_path, capsys):
    """--kv-precision fp16: perplexity close to fp32 KV and reported in the
    JSON; a recurrent model gets one line naming the problem."""
    import json

    from cism import cli
    stories = data_dir / "models" / "stories260K" / "stories260K.bin"
    f = data_dir / "corpora" / "tinyshakespeare.txt"

    def ppl(*extra):
        code = cli.main(["perplexity", "--model", str(stories), "--file", str(f), "--ctx", "128",
                         "--chunks", "3", "--json", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)

    full, half = ppl(), ppl("--kv-precision", "fp16")
    assert (full["kv_precision"], half["kv_precision"]) == ("fp32", "fp16")
    assert half["ppl"] != full["ppl"] and abs(half["ppl"] - full["ppl"]) < 0.01 * full["ppl"]
    from test_fwkv import config, save_dir, weights
    c = config()
    d = save_dir(tmp_path / "fwkv", c, weights(c, 0))
    code = cli.main(["perplexity", "--model", str(d), "--file", str(f), "--kv-precision", "fp16"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "cism: error: --kv-precision fp16 is for dense and Surjo models, not fwkv"


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_non_finite_logits_cancel_the_session(where):
    """Finite weights whose logits overflow (one head row of 3e38s) end the
    session with a RuntimeError naming it, wherever the row sits in the
    vocabulary (the vectorized scan sees every element), and in batches."""
    c = small_config(context=64)
    w = dense_weights(c, seed=1, untied_head=True)
    row = {"first": 0, "middle": c.vocab // 2, "last": c.vocab - 1}[where]
    w["lm_head.weight"][row] = 3e38
    m = Model(c, w, "fp32")
    s = m.create_session([1, 2, 3], 4)
    with pytest.raises(RuntimeError, match="non-finite logits during inference; the session is cancelled"):
        s.next_tokens(2)
    assert s.finish_reason == "cancelled"
    with pytest.raises(RuntimeError, match="non-finite logits"):
        m.create_batch_session([[1, 2], [3, 4, 5]], 3).next_tokens(3)


def _printf_a(value):
    """C's printf("%a") of a double, through libc: the oracle for std::hexfloat."""
    import ctypes
    libc = ctypes.CDLL(None)
    buf = ctypes.create_string_buffer(64)
    libc.snprintf(buf, 64, b"%a", ctypes.c_double(value))
    return buf.value.decode()


def test_hexfloat_writes_what_c_printf_a_writes():
    """compile_canonical writes floats as the spec's std::hexfloat (C's %a):
    "0x1.388p+13", not float.hex()'s "0x1.3880000000000p+13"."""
    import struct
    from cism._config import hexfloat
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 64, 2000, dtype=np.uint64)
    values = [struct.unpack("<d", struct.pack("<Q", int(b)))[0] for b in bits]
    values += [float(np.float32(v)) for v in rng.standard_normal(500) * 10.0 ** rng.integers(-40, 39, 500)]
    values += [0.0, -0.0, 1.0, -1.0, 0.5, 10000.0, 1e-5, 1e-6, 5e-324, -5e-324, 2.2250738585072014e-308,
               2.225073858507201e-308, 1e-310, 1.7976931348623157e308, float(np.float32(1e-45)),
               float("inf"), float("-inf"), float("nan"),
               struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000000))[0]]   # -nan
    for v in values:
        assert hexfloat(v) == _printf_a(v), v
    assert hexfloat(10000.0) == "0x1.388p+13"


def test_compile_canonical_is_the_spec_hexfloat_text():
    m = small_model("llama")
    assert m.compile_canonical == ("llama|64|96|2|4|2|16|97|512|" + _printf_a(float(np.float32(1e-6)))
                                   + "|0x1.388p+13|0")


def _one_token_overflows_attention(config):
    """Weights under which token 5's own attention score overflows to +inf in
    layer 0 (its q and k are 8e19 in every element; every other token's
    embedding is zero in channel 0, so its q and k are zero)."""
    w = dense_weights(config, seed=3)
    w["model.embed_tokens.weight"][:, 0] = 0
    w["model.embed_tokens.weight"][5] = 0
    w["model.embed_tokens.weight"][5, 0] = 1
    w["model.layers.0.input_layernorm.weight"][:] = 1
    for name in ("q_proj", "k_proj"):
        m = w[f"model.layers.0.self_attn.{name}.weight"]
        m[:] = 0
        m[:, 0] = 1e19
    return w


def test_non_finite_attention_score_is_refused_where_no_logits_show_it():
    """The spec's check: every attention score of every token, so a prompt
    whose bad token is out of the last token's sliding window (its logits
    are finite) still fails, with the spec's message."""
    config = small_config("mistral", sliding_window=4)
    m = Model(config, _one_token_overflows_attention(config), "fp32", threads=1)
    prompt = [1, 5] + [2, 3, 4] * 13
    ok = Model(config, _one_token_overflows_attention(config), "fp32", threads=1)
    assert np.isfinite(ok.logits([1, 2, 3])).all()
    with pytest.raises(RuntimeError, match="^non-finite attention score during"):
        m.logits(prompt)
    s = m.create_session(prompt, 4)
    with pytest.raises(RuntimeError, match="non-finite attention score"):
        s.next_tokens(4)
    assert s.finish_reason == "cancelled"
    with pytest.raises(RuntimeError, match="non-finite attention score"):
        m.create_paged_session(prompt, 4).next_tokens(4)


def test_draft_k_is_capped_at_16_with_a_message():
    s = small_model("llama").create_session([1, 2, 3, 1, 2, 3, 1, 2], 4)
    assert len(s.draft(16)) <= 16
    with pytest.raises(ValueError, match=r"k must be at most 16 \(the most candidates verify takes\), got 17"):
        s.draft(17)
