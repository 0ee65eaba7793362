"""Paged KV: the BlockPool against a pure-Python model (hypothesis state
machine), and paged sessions bit-identical to dense sessions through forks,
evictions, recomputes and pool resets."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from cism import OutOfBlocks
from cism.paging import BlockPool

from conftest import hypothesis_examples, hypothesis_or_skip
from models import small_model

PRECISIONS = ["fp32", "fp16", "int8", "hybrid-int4", "hybrid-fp4", "int4", "fp4"]


# ------------------------------------------------------ the pool, modelled ---

# What the pool raises for each failure the model predicts.
FAILURES = {
    "dup": (ValueError, r"BlockPool duplicate allocate for req_id=\d+"),
    "unknown": (ValueError, r"BlockPool unknown (src )?req_id=\d+ in (ensure|fork|copy_on_write|share_block)\(\)"),
    "beyond": (ValueError, r"BlockPool (fork prefix beyond src|copy_on_write position beyond) allocation"),
    "oom": (OutOfBlocks, r"BlockPool out of memory"),
    "free": (ValueError, r"BlockPool (bad phys block id \d+|(retain_block|share_block) of free block \d+)"),
}


class PoolModel:
    """The pool's documented semantics in plain Python."""

    def __init__(self, n):
        self.n = n
        self.free = list(range(n - 1, -1, -1))
        self.table, self.ref, self.prio, self.seq, self.ctr = {}, [0] * n, {}, {}, 0
        self.held = [0] * n  # references taken with retain_block (the prefix cache's)

    def need(self, n):
        return (n + 15) // 16

    def pop(self):
        b = self.free.pop()
        self.ref[b] = 1
        return b

    def allocate(self, r, n):
        if r in self.table:
            return "dup"
        if len(self.free) < self.need(n):
            return "oom"
        self.table[r] = [self.pop() for _ in range(self.need(n))]
        self.prio[r] = 0
        self.ctr += 1
        self.seq[r] = self.ctr

    def ensure(self, r, n):
        if r not in self.table:
            return "unknown"
        miss = self.need(n) - len(self.table[r])
        if miss > len(self.free):
            return "oom"
        for _ in range(max(0, miss)):
            self.table[r].append(self.pop())

    def release(self, r):
        for b in self.table.pop(r):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        self.prio.pop(r)
        self.seq.pop(r)

    def fork(self, d, s, n):
        if d in self.table:
            return "dup"
        if s not in self.table:
            return "unknown"
        full, tail = divmod(n, 16)
        if full + (tail > 0) > len(self.table[s]):
            return "beyond"
        if tail and not self.free:
            return "oom"
        blocks = self.table[s][:full]
        for b in blocks:
            self.ref[b] += 1
        copied = None
        if tail:
            copied = (self.table[s][full], self.pop(), tail)
            blocks.append(copied[1])
        self.table[d] = blocks
        self.prio[d] = self.prio[s]
        self.ctr += 1
        self.seq[d] = self.ctr
        return copied

    def cow(self, r, pos):
        if r not in self.table:
            return "unknown"
        bi = pos // 16
        if bi >= len(self.table[r]):
            return "beyond"
        old = self.table[r][bi]
        if self.ref[old] <= 1:
            return None
        if not self.free:
            return "oom"
        new = self.pop()
        self.ref[old] -= 1
        self.table[r][bi] = new
        return (old, new)

    def in_use(self, b):
        return b < self.n and self.ref[b] > 0

    def retain(self, b):
        if not self.in_use(b):
            return "free"
        self.ref[b] += 1
        self.held[b] += 1

    def release_held(self, b):
        self.ref[b] -= 1
        self.held[b] -= 1
        if self.ref[b] == 0:
            self.free.append(b)

    def share(self, r, b):
        if not self.in_use(b):
            return "free"
        if r not in self.table:
            return "unknown"
        self.ref[b] += 1
        self.table[r].append(b)

    def evict(self, except_req):
        cands = [r for r in self.table if r != except_req]
        if not cands:
            return -1
        victim = min(cands, key=lambda r: (self.prio[r], -self.seq[r]))
        self.release(victim)
        return victim


def pool_machine():
    """The state machine class, built by its test so that only that test needs hypothesis."""
    st = hypothesis_or_skip().strategies
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

    class PoolMachine(RuleBasedStateMachine):
        """The pool against PoolModel, and its pages against what was written:
        tags, one per element of a write (K apart from V, every block, position,
        layer and channel its own), written as a session would: whole blocks at
        allocate/ensure (prefill), the suffix of a fork's private tail block,
        one position after copy_on_write (decode); blocks are also retained,
        released and shared, as the engine's prefix cache does. After every
        step each block in use (in a table or held) must hold exactly its tags,
        so a page lost or mixed up in grow, evict, free, fork, copy-on-write or
        a release fails the invariant. Tags are bit patterns (compared through
        uint views) from a counter: positive finite values, which in float16
        wrap after 31743 tags (a run writes up to ~50k; a block holds 384), so a
        rare repeat can hide a mix-up but never fail a correct pool."""

        def __init__(self):
            super().__init__()
            self.model = PoolModel(6)
            self.k_tags, self.v_tags = {}, {}  # phys -> (layers, 16, ...) of uint, what its page holds
            self.written = 0

        @initialize(heads=st.sampled_from([1, 3]), dtype=st.sampled_from([np.float32, np.float16]))
        def make_pool(self, heads, dtype):
            # kv_width 6: one head, or three heads of 2 (the 5-d page views)
            self.pool = BlockPool(6, 2, 6, dtype=dtype, head_dim=6 // heads)
            self.uint = np.uint16 if dtype == np.float16 else np.uint32
            self.tag_span = 0x7BFF if dtype == np.float16 else 0x7F7FFFFF  # positive finite bit patterns

        def page_bits(self, pages, b):
            return pages[b].view(self.uint)

        def write(self, b, slots=slice(None)):
            """Fresh tags into block b's keys and values at the given slots."""
            for pages, tags in ((self.pool.k_pages, self.k_tags), (self.pool.v_pages, self.v_tags)):
                if b not in tags:
                    tags[b] = np.zeros(pages.shape[1:], self.uint)
                shape = tags[b][:, slots].shape
                n = int(np.prod(shape))
                fresh = (np.arange(self.written, self.written + n) % self.tag_span + 1).astype(self.uint)
                self.written += n
                tags[b][:, slots] = fresh.reshape(shape)
                pages[b, :, slots] = fresh.reshape(shape).view(pages.dtype)

        def copy_tags(self, dst, src, slots=slice(None)):
            for tags in (self.k_tags, self.v_tags):
                tags.setdefault(dst, np.zeros_like(tags[src]))[:, slots] = tags[src][:, slots]

        def snapshot(self):
            return (self.pool.free_stack, self.pool.table, [self.pool.refcount(b) for b in range(self.pool.num_blocks)])

        def same_or_unchanged(self, outcome, call):
            before = self.snapshot()
            k_before, v_before = self.pool.k_pages.copy(), self.pool.v_pages.copy()
            if outcome in FAILURES:
                exc, message = FAILURES[outcome]
                with pytest.raises(exc, match=message):
                    call()
                assert self.snapshot() == before  # failed operations change nothing
                assert np.array_equal(self.pool.k_pages.view(self.uint), k_before.view(self.uint))
                assert np.array_equal(self.pool.v_pages.view(self.uint), v_before.view(self.uint))
                return False
            call()
            return True

        reqs = st.integers(0, 7)

        @rule(r=reqs, n=st.integers(0, 40))
        def allocate(self, r, n):
            out = self.model.allocate(r, n) if r not in self.model.table else "dup"
            if out == "dup":
                with pytest.raises(ValueError, match="duplicate"):
                    self.pool.allocate(r, n)
                return
            if out == "oom":
                self.model.table.pop(r, None)
            self.same_or_unchanged(out, lambda: self.pool.allocate(r, n))
            if out is None:
                for b in self.pool.get_blocks(r):
                    self.write(b)  # prefill

        @rule(r=reqs, n=st.integers(0, 60))
        def ensure(self, r, n):
            before = list(self.model.table.get(r, []))
            out = self.model.ensure(r, n)
            if out == "oom":
                self.model.table[r] = before
            if self.same_or_unchanged(out, lambda: self.pool.ensure(r, n)):
                for b in self.model.table[r][len(before):]:
                    self.write(b)

        @rule(r=reqs)
        def free(self, r):
            if r not in self.model.table:
                with pytest.raises(ValueError, match="double-free"):
                    self.pool.free(r)
                return
            self.model.release(r)
            self.pool.free(r)

        @rule(d=reqs, s=reqs, n=st.integers(0, 48))
        def fork(self, d, s, n):
            src_blocks = list(self.model.table.get(s, []))
            free_before = list(self.model.free)
            out = self.model.fork(d, s, n)
            if isinstance(out, str):
                self.same_or_unchanged(out, lambda: self.pool.fork(d, s, n))
                return
            got = self.pool.fork(d, s, n)
            assert got == self.model.table[d]
            full = n // 16
            assert got[:full] == src_blocks[:full]  # whole blocks are shared, not copied
            if out is not None:
                # the partial tail was copied into a private block (checked by the
                # invariant); the child then writes its suffix after it
                src_b, dst_b, tail = out
                self.copy_tags(dst_b, src_b, slice(None, tail))
                self.write(dst_b, slice(tail, None))
            assert free_before[: len(self.model.free)] == self.model.free

        @rule(r=reqs, pos=st.integers(0, 70))
        def copy_on_write(self, r, pos):
            out = self.model.cow(r, pos)
            if isinstance(out, str):
                self.same_or_unchanged(out, lambda: self.pool.copy_on_write(r, pos))
                return
            self.pool.copy_on_write(r, pos)
            if out:
                old, new = out
                self.copy_tags(new, old)  # a full copy; the shared block stays as it was

        @precondition(lambda self: any(self.model.table.values()))
        @rule(data=st.data())
        def decode_write(self, data):
            """A session writes one position: copy_on_write first, so blocks
            other requests share never change."""
            r = data.draw(st.sampled_from(sorted(q for q, b in self.model.table.items() if b)))
            pos = data.draw(st.integers(0, 16 * len(self.model.table[r]) - 1))
            out = self.model.cow(r, pos)
            if self.same_or_unchanged(out, lambda: self.pool.copy_on_write(r, pos)):
                if out:
                    self.copy_tags(out[1], out[0])
                self.write(self.model.table[r][pos // 16], pos % 16)

        def some_block(self, data):
            """A block in use, mostly, else any id (free, or past the pool)."""
            used = [b for b in range(self.model.n) if self.model.ref[b]]
            return data.draw(st.sampled_from(used) | st.integers(0, 15) if used else st.integers(0, 15))

        @rule(data=st.data())
        def retain_block(self, data):
            b = self.some_block(data)
            out = self.model.retain(b)
            self.same_or_unchanged(out, lambda: self.pool.retain_block(b))

        @precondition(lambda self: any(self.model.held))
        @rule(data=st.data())
        def release_block(self, data):
            b = data.draw(st.sampled_from([b for b, h in enumerate(self.model.held) if h]))
            self.model.release_held(b)
            self.pool.release_block(b)

        @rule(r=reqs, data=st.data())
        def share_block(self, r, data):
            """A cached prefix block appended to a request (the engine shares
            only full blocks; a later write copies it first)."""
            b = self.some_block(data)
            out = self.model.share(r, b)
            self.same_or_unchanged(out, lambda: self.pool.share_block(r, b))

        @rule(r=reqs)
        def evict(self, r):
            assert self.pool.evict_one(r) == self.model.evict(r)

        @precondition(lambda self: self.model.table)
        @rule(data=st.data(), p=st.integers(-3, 3))
        def set_priority(self, data, p):
            r = data.draw(st.sampled_from(sorted(self.model.table)))
            self.model.prio[r] = p
            self.pool.set_priority(r, p)
            assert self.pool.priority(r) == p

        @rule(extra=st.integers(0, 3))
        def grow(self, extra):
            if self.model.n + extra > 14:
                return
            old = self.model.n
            self.model.free.extend(range(self.model.n + extra - 1, self.model.n - 1, -1))
            self.model.ref += [0] * extra
            self.model.held += [0] * extra
            self.model.n += extra
            self.pool.grow(extra)
            for pages in (self.pool.k_pages, self.pool.v_pages):
                assert not pages[old:].view(self.uint).any()  # the new blocks are zeroed

        @invariant()
        def matches_model(self):
            m, p = self.model, self.pool
            assert p.free_stack == m.free
            assert p.table == m.table
            assert len(set(p.free_stack)) == len(p.free_stack)  # no duplicates
            holders = [0] * p.num_blocks
            for blocks in p.table.values():
                for b in blocks:
                    holders[b] += 1
            for b in range(p.num_blocks):
                assert p.refcount(b) == holders[b] + m.held[b] == m.ref[b]
                assert (m.ref[b] == 0) == (b in p.free_stack)  # free or referenced, never both
            assert p.used() == sum(len(b) for b in m.table.values())
            assert p.phys_used() == p.num_blocks - p.free_count() == sum(r > 0 for r in m.ref)
            assert p.usage() == (p.used(), p.free_count(), p.num_blocks)

        @invariant()
        def live_pages_hold_their_tags(self):
            p = self.pool
            assert p.k_pages.shape[0] == p.v_pages.shape[0] == p.num_blocks
            for b in [b for b in range(self.model.n) if self.model.ref[b]]:  # in tables or held
                assert np.array_equal(self.page_bits(p.k_pages, b), self.k_tags[b]), f"K page of block {b}"
                assert np.array_equal(self.page_bits(p.v_pages, b), self.v_tags[b]), f"V page of block {b}"

    return PoolMachine


def test_pool_machine():
    machine = pool_machine()
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test
    run_state_machine_as_test(machine, settings=settings(max_examples=hypothesis_examples(150),
                                                         stateful_step_count=40, deadline=None))



def test_pool_basics_and_errors():
    pool = BlockPool(4, 2, 8)
    assert pool.allocate(1, 17) == [0, 1]  # LIFO: block 0 first
    assert pool.blocks_needed(0) == 0 and pool.blocks_needed(16) == 1 and pool.blocks_needed(17) == 2
    assert pool.can_allocate(32) and not pool.can_allocate(33)
    with pytest.raises(OutOfBlocks, match="need 3 blocks, only 2 free of 4"):
        pool.allocate(2, 40)
    assert not pool.contains(2)
    assert pool.kv_elements() == 4 * 2 * 16 * 8 and pool.kv_bytes() == pool.kv_elements() * 8
    assert pool.k_pages.shape == (4, 2, 16, 8)
    for args, message in [((0, 2, 8), "num_blocks must be positive"),
                          ((1, 257, 8), "num_layers is outside supported bounds"),
                          ((1, 2, 65537), "kv_width is outside supported bounds"),
                          ((1, 2, 8, 32), "block_size must be 16"),
                          ((1 << 20, 256, 65536), "8 GiB safety limit")]:
        with pytest.raises(ValueError, match=message):
            BlockPool(*args)
    with pytest.raises(ValueError, match="8 GiB"):
        pool.grow(1 << 30)
    with pytest.raises(ValueError, match="bad phys block"):
        pool.refcount(4)
    with pytest.raises(ValueError, match="unknown req_id=9"):
        pool.priority(9)


def test_pool_pages_are_views_of_key_tiles_in_either_dtype():
    """The pages keep the spec's (blocks, layers, 16, kv_width) shape as
    views of layer-major memory (a layer's blocks side by side), the keys
    holding each page's keys transposed (kv_width, 16), 64-byte aligned, for
    attention's key tiles; float16 pools (a model's kv_precision "fp16")
    take half the bytes and keep that through grow and copies."""
    for dtype in (np.float32, np.float16):
        pool = BlockPool(3, 2, 8, dtype=dtype)
        k, v = pool.k_pages, pool.v_pages
        assert k.shape == v.shape == (3, 2, 16, 8) and k.dtype == dtype and v.dtype == dtype
        assert k.strides == (8 * 16 * k.itemsize, 3 * 8 * 16 * k.itemsize, k.itemsize, 16 * k.itemsize)
        assert v.strides == (16 * 8 * v.itemsize, 3 * 16 * 8 * v.itemsize, 8 * v.itemsize, v.itemsize)
        assert k.ctypes.data % 64 == 0
        assert pool.kv_bytes() == pool.kv_elements() * 2 * np.dtype(dtype).itemsize
        k[1, 0, 5, 3] = 7
        pool.grow(2)
        assert pool.k_pages.dtype == dtype and pool.k_pages.shape == (5, 2, 16, 8)
        assert pool.k_pages[1, 0, 5, 3] == 7 and pool.k_pages.ctypes.data % 64 == 0
    for bad in ("int8", np.float64, "bf16"):
        with pytest.raises(ValueError, match="dtype must be float32 or float16"):
            BlockPool(1, 1, 8, dtype=bad)


def test_pools_with_heads_keep_each_head_a_stream_of_blocks():
    """With head_dim, each (layer, KV head) is one stream of blocks: keys
    (layers, heads, blocks, head_dim, 16) and values (layers, heads, blocks,
    16, head_dim) in memory, seen as (blocks, layers, 16, heads, head_dim);
    forks, copy-on-write and grow copy through those views."""
    pool = BlockPool(4, 2, 12, head_dim=4)
    k, v = pool.k_pages, pool.v_pages
    item = k.itemsize
    assert k.shape == v.shape == (4, 2, 16, 3, 4) and pool.head_dim == 4
    assert k.strides == (4 * 16 * item, 3 * 4 * 4 * 16 * item, item, 4 * 4 * 16 * item, 16 * item)
    assert v.strides == (16 * 4 * item, 3 * 4 * 16 * 4 * item, 4 * item, 4 * 16 * 4 * item, item)
    assert k.ctypes.data % 64 == 0
    pool.allocate(1, 20)
    b0, b1 = pool.get_blocks(1)
    k[b1, :, :4] = np.arange(2 * 4 * 12).reshape(2, 4, 3, 4)
    v[b1, :, :4] = -k[b1, :, :4]
    pool.fork(2, 1, 20)                        # block 0 shared, the 4-position tail copied
    d = pool.get_blocks(2)[1]
    assert d != b1 and np.array_equal(k[d, :, :4], k[b1, :, :4]) and np.array_equal(v[d, :, :4], v[b1, :, :4])
    pool.grow(3)
    assert pool.k_pages.shape == (7, 2, 16, 3, 4)
    assert np.array_equal(pool.k_pages[d, :, :4], k[b1, :, :4])
    for bad in (0, 5, 24):
        with pytest.raises(ValueError, match="head_dim must divide kv_width"):
            BlockPool(2, 1, 12, head_dim=bad)


# --------------------------------------------------------- paged sessions ---

@pytest.mark.parametrize("precision,kv", [(p, "fp32") for p in PRECISIONS] + [("fp32", "fp16"), ("hybrid-fp4", "fp16"), ("fp4", "fp16")])
def test_paged_equals_dense_through_forks_evictions_and_resets(precision, kv):
    model = small_model("qwen3", precision, seed=21, kv_precision=kv)
    rng = np.random.default_rng(22)
    prompt = list(rng.integers(0, 97, 37))
    dense = model.create_session(prompt, 30)
    paged = model.create_paged_session(prompt, 30)
    want = dense.next_tokens(10)
    assert paged.next_tokens(10) == want
    assert np.array_equal(paged.last_logits, dense.last_logits)
    # a fork sharing the first 33 tokens (two whole blocks and a partial one)
    child_prompt = prompt + [5, 6, 7]
    child = model.create_paged_fork_session(child_prompt, 20, src=paged, prefix_len=33)
    ref = model.create_session(child_prompt, 20)
    assert child.next_tokens(20) == ref.next_tokens(20)
    assert np.array_equal(child.last_logits, ref.last_logits)
    # eviction: the next call recomputes the cache, exactly
    pool = model.paged_pool()
    assert pool.evict_one(-1) != -1 and pool.evict_one(-1) != -1
    assert paged.next_tokens(10) == dense.next_tokens(10)
    assert paged.recomputes == 1
    assert np.array_equal(paged.last_logits, dense.last_logits)
    # a pool reset is safe at any time
    model.paged_pool_reset()
    assert model.paged_pool_usage()[0] == 0
    assert paged.next_tokens(10) == dense.next_tokens(10)
    assert paged.recomputes == 2 and paged.finish_reason == dense.finish_reason == "length"
    assert np.array_equal(model.paged_logits(prompt), model.logits(prompt))


def test_paged_sessions_speculate_through_evictions():
    """A paged session runs DecodeSession's loop: prompt-lookup speculation
    gives plain greedy's tokens, also when another session evicts it between
    calls (it recomputes, then verifies blocks again)."""
    model = small_model("llama", seed=30)
    model.paged_pool_reset(6)
    pattern = [5, 9, 14, 3, 22, 7]
    prompt = (pattern * 7)[:40]
    want = model.create_session(prompt, 40).next_tokens(40)
    s = model.create_paged_session(prompt, 40)
    other = model.create_paged_session(list(range(1, 60)), 20)
    got = []
    while not s.finish_reason:
        got += s.next_tokens(7, spec_k=6)
        other.next_tokens(2)      # it needs blocks: at times it evicts s
    assert got == want
    proposed, accepted = s.spec_stats()
    assert proposed > 0 and accepted > 0 and s.recomputes > 0
    with pytest.raises(ValueError, match="spec_k"):
        model.create_paged_session(prompt, 4, temperature=0.5).next_tokens(4, spec_k=4)


def test_sampled_paged_streams_match_and_forks_of_forks():
    model = small_model("llama", seed=23)
    prompt = list(range(1, 40))
    a = model.create_session(prompt, 25, temperature=0.8, top_k=30, seed=9).next_tokens(25)
    p = model.create_paged_session(prompt, 25, temperature=0.8, top_k=30, seed=9)
    assert p.next_tokens(25) == a
    src = model.create_paged_session(prompt, 5)
    assert src.prefill_fork_source() and src.prefill_fork_source()
    # empty suffix: seeded from the source's logits
    c1 = model.create_paged_fork_session(prompt, 12, src=src, prefix_len=len(prompt))
    c1.next_tokens(4)
    grand = model.create_paged_fork_session(c1.history + [3], 8, src=c1, prefix_len=len(c1.history))
    want = model.create_session(c1.history + [3], 8).next_tokens(8)
    assert grand.next_tokens(8) == want
    assert c1.next_tokens(8) == model.create_session(prompt, 12).next_tokens(12)[4:]


def test_fork_errors():
    model = small_model("llama", seed=24)
    other = small_model("llama", seed=25)
    src = model.create_paged_session([1, 2, 3, 4], 5)
    with pytest.raises(ValueError, match="fork source session is null"):
        model.create_paged_fork_session([1, 2], 3, src=None, prefix_len=1)
    with pytest.raises(ValueError, match="different model"):
        other.create_paged_fork_session([1, 2], 3, src=src, prefix_len=1)
    with pytest.raises(ValueError, match="fork with empty prompt"):
        model.create_paged_fork_session([], 3, src=src, prefix_len=0)
    with pytest.raises(ValueError, match="fork prefix longer than child prompt"):
        model.create_paged_fork_session([1, 2], 3, src=src, prefix_len=3)
    with pytest.raises(ValueError, match="fork prefix longer than source history"):
        model.create_paged_fork_session([1, 2, 3, 9], 3, src=src, prefix_len=2)
    src.prefill_fork_source()
    with pytest.raises(ValueError, match="fork prefix tokens differ"):
        model.create_paged_fork_session([1, 9, 3, 4], 3, src=src, prefix_len=3)
    src.next_tokens(2)
    with pytest.raises(ValueError, match="advanced past the shared prefix"):
        model.create_paged_fork_session([1, 2, 3, 4], 3, src=src, prefix_len=4)
    fresh = model.create_paged_session([1, 2, 3, 4], 3)
    with pytest.raises(ValueError, match="no forward output"):
        model.create_paged_fork_session([1, 2, 3, 4], 3, src=fresh, prefix_len=4)
    with pytest.raises(ValueError, match="empty prompt"):
        model.create_paged_fork_session([], 3, src=fresh, prefix_len=0)
    src2 = model.create_paged_session([1, 2, 3, 4, 5], 3)
    src2.prefill_fork_source()
    model.paged_pool().free(src2.req_id)
    with pytest.raises(RuntimeError, match="fork source was evicted"):
        model.create_paged_fork_session([1, 2, 3, 4, 5, 6], 3, src=src2, prefix_len=5)


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_many_sessions_in_a_tiny_pool(blocks):
    model = small_model("llama", seed=26)
    model.paged_pool_reset(blocks)
    assert model.paged_pool_max_blocks() == blocks
    rng = np.random.default_rng(blocks)
    prompts = [list(rng.integers(0, 97, int(rng.integers(2, 8)))) for _ in range(6)]
    budget = 16 * blocks - 8
    sessions = [model.create_paged_session(p, budget) for p in prompts]
    outs = [[] for _ in prompts]
    for _ in range(budget // 3 + 1):  # interleaved: they keep evicting each other
        for i, s in enumerate(sessions):
            outs[i] += s.next_tokens(3)
    for p, out, s in zip(prompts, outs, sessions):
        assert out == model.create_session(p, budget).next_tokens(budget)
        assert s.finish_reason == "length"
    assert sum(s.recomputes for s in sessions) > 0
    big = model.create_paged_session([1], 16 * blocks + 1)
    with pytest.raises(OutOfBlocks, match="BlockPool out of memory"):
        big.next_tokens(16 * blocks + 1)
    assert big.finish_reason == "cancelled"


def test_priorities_decide_who_is_evicted():
    model = small_model("llama", seed=27)
    model.paged_pool_reset(4)
    a = model.create_paged_session(list(range(17)), 10, priority=5)  # two blocks each
    b = model.create_paged_session(list(range(20, 37)), 10)
    a.next_tokens(1)
    b.next_tokens(1)
    c = model.create_paged_session([7, 8], 10)
    c.next_tokens(1)  # needs a block: the newest lowest-priority holder (b) goes
    pool = model.paged_pool()
    assert pool.contains(a.req_id) and not pool.contains(b.req_id) and pool.contains(c.req_id)
    b.set_priority(9)
    assert b.priority == 9
    b.next_tokens(1)  # b comes back and pushes out c, now the only lowest priority
    assert b.recomputes == 1 and a.recomputes == 0
    assert pool.contains(a.req_id) and pool.contains(b.req_id) and not pool.contains(c.req_id)


def test_release_and_env_cap():
    model = small_model("llama", seed=28)
    s = model.create_paged_session(list(range(40)), 5)
    s.next_tokens(2)
    assert model.paged_pool_usage()[0] == 3
    del s
    assert model.paged_pool_usage()[0] == 0
    code = ("import sys; sys.path.insert(0, %r); from models import small_model; "
            "m = small_model(); print(m.paged_pool_max_blocks())" % os.path.dirname(__file__))
    for env, want in (("7", "7"), ("0", "256"), ("junk", "256"), ("99999999", str(1 << 20))):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CISM_PAGED_MAX_BLOCKS": env},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == want, env


def test_threads_driving_paged_sessions():
    model = small_model("llama", seed=29)
    model.paged_pool_reset(8)
    prompts = [list(range(i, i + 9)) for i in range(6)]
    want = [model.create_session(p, 30).next_tokens(30) for p in prompts]
    got = [None] * 6

    def run(i):
        s = model.create_paged_session(prompts[i], 30)
        out = []
        while not s.finish_reason:
            out += s.next_tokens(4)
        got[i] = out

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def _strtoll(text):
    """libc's strtoll(text, &end, 10) as std::stoll uses it: the value, or
    None where std::stoll throws (no digits: invalid_argument; ERANGE:
    out_of_range). The oracle for cism._config.stoll."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.strtoll.restype = ctypes.c_longlong
    libc.strtoll.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]
    raw = ctypes.create_string_buffer(text.encode("utf-8"))
    end = ctypes.c_char_p()
    ctypes.set_errno(0)
    value = libc.strtoll(raw, ctypes.byref(end), 10)
    consumed = ctypes.cast(end, ctypes.c_void_p).value - ctypes.addressof(raw)
    if consumed == 0 or ctypes.get_errno() != 0:
        return None
    return value


def test_stoll_reads_as_libc_strtoll():
    from cism._config import stoll
    rng = np.random.default_rng(11)
    alphabet = list(" \t\n\v\f\r+-0123456789ax_.") + ["\u00a0", "\u0662"]
    cases = ["", " ", "7", "+7", "-7", " \t\n12abc", "12 ", "0x10", "1_000", "1e3", "+-1", "- 1", "abc",
             "9223372036854775807", "9223372036854775808", "-9223372036854775808",
             "-9223372036854775809", "99999999999999999999", "000012", "\u00a012", "\u0662"]
    cases += ["".join(rng.choice(alphabet, rng.integers(0, 12))) for _ in range(3000)]
    for text in cases:
        want = _strtoll(text)
        if want is None:
            with pytest.raises(ValueError, match="^stoll$"):
                stoll(text)
        else:
            assert stoll(text) == want, repr(text)


def test_env_cap_is_read_as_std_stoll():
    """CISM_PAGED_MAX_BLOCKS as the spec reads it: std::stoll's leading digits
    ("12abc" is 12, " +9" is 9); no digits or a value beyond long long leaves
    the default 256 (the spec catches stoll's exceptions), as does a value <= 0."""
    code = ("import sys; sys.path.insert(0, %r); from models import small_model; "
            "m = small_model(); print(m.paged_pool_max_blocks())" % os.path.dirname(__file__))
    for env, want in (("12abc", "12"), (" +9", "9"), ("\t5 blocks", "5"), ("-3", "256"), ("abc", "256"),
                      ("99999999999999999999", "256"), ("3000000", str(1 << 20))):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CISM_PAGED_MAX_BLOCKS": env},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == want, env


def test_block_pool_total_is_num_blocks():
    pool = BlockPool(5, 2, 8)
    assert pool.total() == 5 == pool.usage()[2]
    pool.allocate(1, 40)
    assert pool.total() == 5
    pool.grow(3)
    assert pool.total() == 8 == pool.num_blocks
