"""Batched decoding: each sequence equals running it alone, bit for bit."""
import threading

import numpy as np
import pytest

from models import small_model

PRECISIONS = ["fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"]


def prompts_of(n, seed=0, vocab=97):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, vocab, int(rng.integers(1, 40)))) for _ in range(n)]


@pytest.mark.parametrize("precision,kv", [(p, "fp32") for p in PRECISIONS] + [("int8", "fp16"), ("hybrid-int4", "fp16"), ("int4", "fp16")])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batch_equals_solo(precision, kv, temperature):
    model = small_model("qwen3", precision, seed=31, kv_precision=kv)
    prompts = prompts_of(7, seed=1)
    solo = [model.create_session(p, 24, temperature=temperature, top_k=50, seed=100 + i)
            for i, p in enumerate(prompts)]
    want = [s.next_tokens(24) for s in solo]
    batch = model.create_batch_session(prompts, 24, temperature=temperature, top_k=50, seed=100)
    got = [[] for _ in prompts]
    for n in (1, 5, 30):  # calls of different sizes continue from fresh logits
        for i, out in enumerate(batch.next_tokens(n)):
            got[i] += out
    assert got == want
    assert batch.finish_reasons() == ["length"] * 7
    assert batch.generated_tokens_list() == [24] * 7 and batch.batch_size == 7


def test_batch_logits_are_bitwise_equal_and_finishing_is_mixed():
    model = small_model("llama", "fp32", seed=32)
    prompts = prompts_of(5, seed=2)
    greedy = [model.create_session(p, 20).next_tokens(20) for p in prompts]
    eos = greedy[1][3]  # sequence 1 stops early; others may too, at their own times
    batch = model.create_batch_session(prompts, 20, eos=[eos], seq_seeds=[7, 7, 7, 7, 7])
    outs = batch.next_tokens(6)
    solos = [model.create_session(p, 20, eos=[eos]) for p in prompts]
    for i, s in enumerate(solos):
        assert outs[i] == s.next_tokens(6)
        if s.finish_reason == "":
            assert np.array_equal(batch.last_logits(i), s.last_logits)
    assert batch.finish_reasons()[1] == "stop"
    rest = batch.next_tokens(20)
    for i, s in enumerate(solos):
        assert rest[i] == s.next_tokens(20)
        assert batch.finish_reasons()[i] == s.finish_reason


def test_cancelled_members_and_whole_batch():
    model = small_model("llama", seed=33)
    prompts = prompts_of(4, seed=3)
    want = [model.create_session(p, 30).next_tokens(30) for p in prompts]
    batch = model.create_batch_session(prompts, 30)
    first = batch.next_tokens(10)
    batch.cancel_seq(2)
    second = batch.next_tokens(30)
    assert second[2] == [] and batch.finish_reasons()[2] == "cancelled"
    for i in (0, 1, 3):
        assert first[i] + second[i] == want[i]
    big = small_model("llama", seed=33, context=4096)
    b2 = big.create_batch_session(prompts, 3000)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", b2.next_tokens(3000)))
    t.start()
    b2.cancel()
    t.join()
    assert b2.finish_reasons() == ["cancelled"] * 4 and all(len(o) < 3000 for o in box["out"])
    assert b2.next_tokens(5) == [[], [], [], []]


def test_batch_validation_messages():
    model = small_model("llama", context=64)
    for args, kw, msg in [
        (([], 4), {}, "at least one sequence"),
        (([[1]] * 257, 4), {}, "batch size exceeds 256"),
        (([[1], []], 4), {}, "each prompt must contain at least one token"),
        (([[1], [97]], 4), {}, "outside the vocabulary"),
        (([[1]], -1), {}, "max_new_tokens"),
        (([[1]], 64), {}, "exceeds max_position_embeddings"),
        (([[1]], 4), {"temperature": -1}, "temperature"),
        (([[1]], 4), {"top_p": 2}, "top_p"),
        (([[1]], 4), {"top_k": 98}, "top_k"),
        (([[1]], 4), {"eos": [100]}, "outside the vocabulary"),
        (([[1], [2]], 4), {"seq_seeds": [1]}, "seq_seeds length must match prompts"),
        (("hello", 4), {}, "list of token-id sequences"),
    ]:
        with pytest.raises(ValueError, match=msg):
            model.create_batch_session(*args, **kw)
    b = model.create_batch_session([[1], [2]], 4)
    with pytest.raises(ValueError, match="batch index is out of range"):
        b.cancel_seq(2)
    with pytest.raises(ValueError, match="count must be a nonnegative integer"):
        b.next_tokens(-1)
