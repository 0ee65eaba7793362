"""The paged KV block pool (``cism.paging.BlockPool``).

Keys and values live in two page arrays of shape
``(num_blocks, num_layers, block_size, kv_width)`` (float32 or float16). A
request (one session) owns an ordered list of blocks; position p of a
request lives in slot p % 16 of its block p // 16. Both arrays are views of
memory ordered (layers, KV heads, blocks, ...) when the pool knows the
model's head_dim: attention reads one (layer, head) stream at a time, and a
request whose blocks are consecutive reads it as one run, as from a
contiguous cache. The key memory holds each (layer, head, block)
transposed, (head_dim, 16), 64-byte aligned: the key tiles that attention
reads with keys in lanes (cism/_kvcache.pxd, csrc/kernels.h scores16).

- The free stack is LIFO; a new pool hands out block 0 first.
- Blocks are reference counted. ``fork`` shares a source's whole prefix
  blocks and copies a partial tail block once into a private block; writers
  call ``copy_on_write`` first, so shared pages are never modified.
- ``evict_one`` frees the newest request among those of the lowest priority
  (recompute, not swap: the victim rebuilds its keys from its tokens later).
- Failed operations leave the pool exactly as it was.
"""
import numpy as np

cimport numpy as cnp

from cism._config import MAX_KV_BYTES, is_int

cnp.import_array()

BLOCK_SIZE = 16


def _aligned_zeros(n, dtype):
    size = np.dtype(dtype).itemsize
    buf = np.zeros(n + 64 // size, dtype)
    skip = (-buf.ctypes.data // size) % (64 // size)
    return buf[skip: skip + n]


def _key_pages(blocks, layers, kv_width, head_dim, dtype):
    """Zeroed key pages as a view of 64-byte aligned (layers, kv_heads,
    blocks, head_dim, 16) memory: for each (layer, KV head) its blocks side
    by side, each holding that head's keys of 16 positions transposed (a
    key tile). The view is (blocks, layers, 16, kv_width), or (blocks,
    layers, 16, kv_heads, head_dim) when a block has several heads."""
    heads = kv_width // head_dim
    n = blocks * layers * kv_width * BLOCK_SIZE
    mem = _aligned_zeros(n, dtype).reshape(layers, heads, blocks, head_dim, BLOCK_SIZE)
    view = mem.transpose(2, 0, 4, 1, 3)
    return view.reshape(blocks, layers, BLOCK_SIZE, kv_width) if heads == 1 else view


def _value_pages(blocks, layers, kv_width, head_dim, dtype):
    """Zeroed value pages: (layers, kv_heads, blocks, 16, head_dim) memory,
    viewed as the key pages are."""
    heads = kv_width // head_dim
    n = blocks * layers * kv_width * BLOCK_SIZE
    mem = _aligned_zeros(n, dtype).reshape(layers, heads, blocks, BLOCK_SIZE, head_dim)
    view = mem.transpose(2, 0, 3, 1, 4)
    return view.reshape(blocks, layers, BLOCK_SIZE, kv_width) if heads == 1 else view


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks for the request."""


def _req(value, name="req_id"):
    if not is_int(value) or not -2**63 <= value < 2**63:
        raise ValueError(f"{name} must be a 64-bit integer, got {value!r}")
    return int(value)


def _count(value, name):
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a nonnegative integer, got {value!r}")
    return int(value)


cdef class BlockPool:
    """``BlockPool(num_blocks, num_layers, kv_width, block_size=16,
    dtype=np.float32, head_dim=None)``. With ``head_dim`` (a divisor of
    kv_width: a model's KV heads), each head's keys and values of a layer
    lie in their own stream of blocks, and the page views are (blocks,
    layers, 16, kv_heads, head_dim)."""
    cdef readonly size_t num_blocks, num_layers, kv_width, block_size, head_dim
    cdef list free_stack_
    cdef dict table_
    cdef list refcounts
    cdef dict prio
    cdef dict seq
    cdef unsigned long long seq_ctr
    cdef object k_pages_, v_pages_
    cdef readonly object dtype

    def __init__(self, num_blocks, num_layers, kv_width, block_size=BLOCK_SIZE, dtype=np.float32,
                 head_dim=None):
        num_blocks = _count(num_blocks, "num_blocks")
        num_layers = _count(num_layers, "num_layers")
        kv_width = _count(kv_width, "kv_width")
        block_size = _count(block_size, "block_size")
        if num_blocks == 0:
            raise ValueError("BlockPool num_blocks must be positive")
        if not 1 <= num_layers <= 256:
            raise ValueError(f"BlockPool num_layers is outside supported bounds [1, 256]: got {num_layers}")
        if not 1 <= kv_width <= 65536:
            raise ValueError(f"BlockPool kv_width is outside supported bounds [1, 65536]: got {kv_width}")
        if not 1 <= block_size <= 1024:
            raise ValueError(f"BlockPool block_size must be positive (at most 1024): got {block_size}")
        if block_size != BLOCK_SIZE:
            raise ValueError(f"BlockPool block_size must be 16, got {block_size}")
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            dtype = None
        if dtype not in (np.float32, np.float16):
            raise ValueError("BlockPool dtype must be float32 or float16 (the model's kv_precision)")
        head_dim = kv_width if head_dim is None else _count(head_dim, "head_dim")
        if head_dim == 0 or kv_width % head_dim:
            raise ValueError(f"BlockPool head_dim must divide kv_width ({kv_width}), got {head_dim}")
        self.head_dim = head_dim
        self.dtype = dtype
        self.num_layers = num_layers
        self.kv_width = kv_width
        self.block_size = block_size
        self.num_blocks = 0
        self._check_bytes(num_blocks)
        try:
            self.k_pages_ = _key_pages(num_blocks, num_layers, kv_width, head_dim, dtype)
            self.v_pages_ = _value_pages(num_blocks, num_layers, kv_width, head_dim, dtype)
        except MemoryError:
            raise MemoryError(f"cannot allocate a KV pool of {num_blocks} blocks") from None
        self.num_blocks = num_blocks
        self.refcounts = [0] * num_blocks
        self.free_stack_ = list(range(num_blocks - 1, -1, -1))
        self.table_ = {}
        self.prio = {}
        self.seq = {}
        self.seq_ctr = 0

    def _check_bytes(self, blocks):
        nbytes = blocks * self.num_layers * self.block_size * self.kv_width * self.dtype.itemsize * 2
        if nbytes > MAX_KV_BYTES:
            raise ValueError(f"KV cache exceeds the 8 GiB safety limit ({blocks} blocks "
                             f"of {self.num_layers} layers x {self.kv_width} {self.dtype} values)")

    # ---- sizes ----

    def blocks_needed(self, seq_len):
        seq_len = _count(seq_len, "seq_len")
        return (seq_len + self.block_size - 1) // self.block_size

    def can_allocate(self, seq_len):
        return len(self.free_stack_) >= self.blocks_needed(seq_len)

    def used(self):
        """Logical blocks in use: a block shared by n requests counts n times."""
        return sum(len(b) for b in self.table_.values())

    def phys_used(self):
        """Physical blocks in use (shared blocks count once)."""
        return self.num_blocks - len(self.free_stack_)

    def free_count(self):
        return len(self.free_stack_)

    def total(self):
        """Physical blocks in the pool (num_blocks; grows with grow())."""
        return self.num_blocks

    def usage(self):
        """(used, free, total)."""
        return (self.used(), len(self.free_stack_), self.num_blocks)

    def kv_elements(self):
        return self.num_blocks * self.num_layers * self.block_size * self.kv_width

    def kv_bytes(self):
        return self.kv_elements() * self.dtype.itemsize * 2

    # ---- allocation ----

    def allocate(self, req_id, seq_len):
        """Blocks for seq_len tokens of a new request (all or nothing)."""
        req_id = _req(req_id)
        need = self.blocks_needed(seq_len)
        if req_id in self.table_:
            raise ValueError(f"BlockPool duplicate allocate for req_id={req_id}")
        if len(self.free_stack_) < need:
            raise OutOfBlocks(f"BlockPool out of memory: need {need} blocks, only "
                              f"{len(self.free_stack_)} free of {self.num_blocks}")
        blocks = [self._pop() for _ in range(need)]
        self.table_[req_id] = blocks
        self.prio[req_id] = 0
        self.seq_ctr += 1
        self.seq[req_id] = self.seq_ctr
        return list(blocks)

    cdef object _pop(self):
        phys = self.free_stack_.pop()
        self.refcounts[phys] = 1
        return phys

    def ensure(self, req_id, new_len):
        """Grow a request to cover new_len tokens (never shrinks); on failure
        the request keeps what it had."""
        req_id = _req(req_id)
        need = self.blocks_needed(new_len)
        blocks = self.table_.get(req_id)
        if blocks is None:
            raise ValueError(f"BlockPool unknown req_id={req_id} in ensure()")
        missing = need - len(blocks)
        if missing > 0:
            if len(self.free_stack_) < missing:
                raise OutOfBlocks(f"BlockPool out of memory in ensure(): need {missing} more "
                                  f"blocks, only {len(self.free_stack_)} free")
            blocks.extend(self._pop() for _ in range(missing))
        return list(blocks)

    def free(self, req_id):
        """Release a request; shared blocks return to the free stack only when
        their last holder lets go. Returns the request's block list."""
        req_id = _req(req_id)
        if req_id not in self.table_:
            raise ValueError(f"BlockPool unknown req_id={req_id} (double-free?)")
        blocks = list(self.table_[req_id])
        self._release(req_id)
        return blocks

    cdef _release(self, req_id):
        for b in self.table_[req_id]:
            if self.refcounts[b] == 0:
                raise RuntimeError("BlockPool double-release of block")
            self.refcounts[b] -= 1
            if self.refcounts[b] == 0:
                self.free_stack_.append(b)
        del self.table_[req_id]
        self.prio.pop(req_id, None)
        self.seq.pop(req_id, None)

    # ---- sharing ----

    def refcount(self, phys):
        if not is_int(phys) or not 0 <= phys < self.num_blocks:
            raise ValueError(f"BlockPool bad phys block id {phys!r}")
        return self.refcounts[phys]

    def fork(self, dst_req, src_req, prefix_len):
        """A new request dst sharing src's first prefix_len tokens: whole
        blocks are shared, a partial tail block is copied into a private
        block. On failure nothing changes."""
        dst_req = _req(dst_req, "dst_req")
        src_req = _req(src_req, "src_req")
        prefix_len = _count(prefix_len, "prefix_len")
        if dst_req in self.table_:
            raise ValueError(f"BlockPool duplicate allocate for req_id={dst_req}")
        src = self.table_.get(src_req)
        if src is None:
            raise ValueError(f"BlockPool unknown src req_id={src_req} in fork()")
        full, tail = divmod(prefix_len, self.block_size)
        if full + (1 if tail else 0) > len(src):
            raise ValueError("BlockPool fork prefix beyond src allocation")
        if tail and not self.free_stack_:
            raise OutOfBlocks("BlockPool out of memory in fork()")
        blocks = list(src[:full])
        for b in blocks:
            self.refcounts[b] += 1
        if tail:
            # the child writes its suffix into this block, so it must be private
            s = src[full]
            d = self._pop()
            self.k_pages_[d, :, :tail] = self.k_pages_[s, :, :tail]
            self.v_pages_[d, :, :tail] = self.v_pages_[s, :, :tail]
            blocks.append(d)
        self.table_[dst_req] = blocks
        self.prio[dst_req] = self.prio.get(src_req, 0)
        self.seq_ctr += 1
        self.seq[dst_req] = self.seq_ctr
        return list(blocks)

    # ---- references held outside requests (the engine's prefix cache) ----

    def _in_use(self, phys, what):
        if not is_int(phys) or not 0 <= phys < self.num_blocks:
            raise ValueError(f"BlockPool bad phys block id {phys!r}")
        if self.refcounts[phys] == 0:
            raise ValueError(f"BlockPool {what} of free block {phys}")
        return int(phys)

    def retain_block(self, phys):
        """Hold one more reference to a block in use (it stays out of the
        free stack until every holder has let go)."""
        phys = self._in_use(phys, "retain_block")
        self.refcounts[phys] += 1

    def release_block(self, phys):
        """Drop one reference taken with retain_block; a block nobody holds
        returns to the free stack."""
        phys = self._in_use(phys, "release_block")
        self.refcounts[phys] -= 1
        if self.refcounts[phys] == 0:
            self.free_stack_.append(phys)

    def share_block(self, req_id, phys):
        """Append a block in use (a cached prefix block) to a request's
        table, as one more holder of it. The request must not write into
        it: only full blocks are shared."""
        req_id = _req(req_id)
        phys = self._in_use(phys, "share_block")
        blocks = self.table_.get(req_id)
        if blocks is None:
            raise ValueError(f"BlockPool unknown req_id={req_id} in share_block()")
        self.refcounts[phys] += 1
        blocks.append(phys)

    def copy_on_write(self, req_id, pos):
        """Make the block holding position pos private to req_id (a full copy
        of the shared block) before it is written."""
        req_id = _req(req_id)
        pos = _count(pos, "pos")
        blocks = self.table_.get(req_id)
        if blocks is None:
            raise ValueError(f"BlockPool unknown req_id={req_id} in copy_on_write()")
        bi = pos // self.block_size
        if bi >= len(blocks):
            raise ValueError("BlockPool copy_on_write position beyond allocation")
        phys = blocks[bi]
        if self.refcounts[phys] <= 1:
            return
        if not self.free_stack_:
            raise OutOfBlocks("BlockPool out of memory in copy_on_write()")
        fresh = self._pop()
        self.k_pages_[fresh] = self.k_pages_[phys]
        self.v_pages_[fresh] = self.v_pages_[phys]
        self.refcounts[phys] -= 1
        blocks[bi] = fresh

    # ---- pressure ----

    def evict_one(self, except_req=-1):
        """Free the newest request among those with the lowest priority
        (never except_req); returns its id, or -1 when nothing is evictable."""
        except_req = _req(except_req, "except_req")
        victim = None
        for rid in self.table_:
            if rid == except_req:
                continue
            key = (self.prio.get(rid, 0), -self.seq.get(rid, 0))
            if victim is None or key < victim[0]:
                victim = (key, rid)
        if victim is None:
            return -1
        self._release(victim[1])
        return victim[1]

    def set_priority(self, req_id, priority):
        req_id = _req(req_id)
        if not is_int(priority) or not -2**31 <= priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {priority!r}")
        if req_id not in self.table_:
            raise ValueError(f"BlockPool unknown req_id={req_id} in set_priority()")
        self.prio[req_id] = int(priority)

    def priority(self, req_id):
        req_id = _req(req_id)
        if req_id not in self.prio:
            raise ValueError(f"BlockPool unknown req_id={req_id}")
        return self.prio[req_id]

    def grow(self, extra_blocks):
        """Add extra_blocks zeroed blocks (pushed on the free stack so the
        lowest new id comes out first). Never shrinks."""
        extra_blocks = _count(extra_blocks, "extra_blocks")
        if extra_blocks == 0:
            return
        total = self.num_blocks + extra_blocks
        self._check_bytes(total)
        k = _key_pages(total, self.num_layers, self.kv_width, self.head_dim, self.dtype)
        v = _value_pages(total, self.num_layers, self.kv_width, self.head_dim, self.dtype)
        k[: self.num_blocks] = self.k_pages_
        v[: self.num_blocks] = self.v_pages_
        self.k_pages_, self.v_pages_ = k, v
        self.refcounts.extend([0] * extra_blocks)
        self.free_stack_.extend(range(total - 1, self.num_blocks - 1, -1))
        self.num_blocks = total

    # ---- inspection ----

    def contains(self, req_id):
        return _req(req_id) in self.table_

    def get_blocks(self, req_id):
        req_id = _req(req_id)
        if req_id not in self.table_:
            raise ValueError(f"BlockPool unknown req_id={req_id}")
        return list(self.table_[req_id])

    @property
    def free_stack(self):
        return list(self.free_stack_)

    @property
    def table(self):
        return {r: list(b) for r, b in self.table_.items()}

    @property
    def k_pages(self):
        """The key pages, (num_blocks, num_layers, block_size, kv_width) of the
        pool's dtype (a view of memory that keeps each page's keys transposed)."""
        return self.k_pages_

    @property
    def v_pages(self):
        return self.v_pages_

    def __repr__(self):
        used, free, total = self.usage()
        return (f"BlockPool(num_blocks={total}, num_layers={self.num_layers}, "
                f"kv_width={self.kv_width}, used={used}, phys_used={self.phys_used()}, free={free})")
