# KV caches in key tiles, their addressing (contiguous or through a block
# table into pool pages), and the loops over key tiles and value runs that
# attention reads them with (cimport cism._kvcache; dense layers, Surjo's
# XSA slots). Inlined into each module, compiled without FMA contraction.
from libc.stdlib cimport calloc, free, malloc
from libc.stdint cimport uint16_t
from libc.string cimport memcpy, memset
from cism._kernels cimport cism_kernels

cdef extern from * nogil:
    void __builtin_prefetch(const void *addr, int rw, int locality)

cdef struct KV:
    # A KV cache (dense models: per layer; Surjo: per XSA slot, as `layers`).
    # Keys sit in key tiles: one KV head's keys of 16 consecutive positions
    # of a layer transposed, (head_dim, 16) elements with position p in lane
    # p & 15, which is what the scores16 kernels read (keys in lanes).
    # Contiguous caches keep each (layer, KV head) as one stream: keys
    # (layers, kv_heads, capacity / 16, head_dim, 16) from keys_mem (zeroed,
    # 64-byte aligned), values (layers, kv_heads, capacity, head_dim).
    # Paged: the pool's pages (nblocks of them), keys (layers, kv_heads,
    # nblocks, head_dim, 16) and values (layers, kv_heads, nblocks, 16,
    # head_dim): each (layer, KV head) a stream of blocks, so consecutive
    # blocks read as one run; `blocks` maps position // 16 to a page.
    # Elements are float32, or binary16 (esize 2) when the model's
    # kv_precision is fp16; offsets below are in elements.
    char *keys
    char *values
    void *keys_mem
    size_t capacity
    const size_t *blocks
    size_t nblocks
    size_t layers, kv_width, kv_heads, head_dim, esize


cdef inline size_t kv_cache_bytes(size_t esize, size_t layers, size_t capacity, size_t kv_width) noexcept nogil:
    """Bytes of a contiguous cache: values by position, keys by whole tiles of 16."""
    return esize * layers * (capacity + (capacity + 15) // 16 * 16) * kv_width


cdef inline size_t kv_block_bytes(size_t esize, size_t layers, size_t kv_width) noexcept nogil:
    """Bytes of one pool block: 16 positions' keys and values in every layer."""
    return layers * 16 * kv_width * 2 * esize


cdef inline int kv_alloc(KV *kv, size_t layers, size_t capacity, size_t kv_heads, size_t head_dim,
                         size_t esize) noexcept nogil:
    """A contiguous cache for capacity positions (once: a second call keeps
    the first's memory). Keys are zeroed (calloc: lazily, page by page), so
    the lanes of the last tile past the written positions hold zeros, never
    stray bits. All or nothing: 0, or -1 with nothing left allocated."""
    cdef size_t tiles = (capacity + 15) >> 4
    kv.capacity = capacity
    kv.blocks = NULL
    kv.nblocks = 0
    kv.layers = layers
    kv.kv_heads = kv_heads
    kv.head_dim = head_dim
    kv.kv_width = kv_heads * head_dim
    kv.esize = esize
    if kv.keys_mem != NULL:
        return 0
    kv.keys_mem = calloc(layers * tiles * 16 * kv.kv_width * esize + 64, 1)
    kv.values = <char*>malloc(layers * capacity * kv.kv_width * esize + 64)
    if kv.keys_mem == NULL or kv.values == NULL:
        kv_free(kv)
        return -1
    kv.keys = <char*>((<size_t>kv.keys_mem + 63) // 64 * 64)
    return 0


cdef inline void kv_free(KV *kv) noexcept nogil:
    free(kv.keys_mem)
    free(kv.values)
    kv.keys_mem = NULL
    kv.keys = NULL
    kv.values = NULL


cdef inline int kv_array(KV **kvs, size_t *cap, size_t n) noexcept nogil:
    """Room for n KV structs in kvs (contents not kept): 0, or -1 without memory."""
    if n > cap[0]:
        free(kvs[0])
        cap[0] = 0
        kvs[0] = <KV*>calloc(n, sizeof(KV))
        if kvs[0] == NULL:
            return -1
        cap[0] = n
    return 0


cdef inline void kv_paged(KV *kv, char *keys, char *values, const size_t *blocks, size_t nblocks,
                          size_t layers, size_t kv_heads, size_t head_dim, size_t esize) noexcept nogil:
    """kv as one sequence's view of a BlockPool's pages through its block table."""
    kv.keys = keys
    kv.values = values
    kv.keys_mem = NULL
    kv.blocks = blocks
    kv.nblocks = nblocks
    kv.capacity = 0
    kv.layers = layers
    kv.kv_heads = kv_heads
    kv.head_dim = head_dim
    kv.kv_width = kv_heads * head_dim
    kv.esize = esize


cdef inline char *k_tile(const KV *kv, size_t l, size_t kvh, size_t pos) noexcept nogil:
    """KV head kvh's key tile holding position pos (in lane pos & 15)."""
    if kv.blocks == NULL:
        return kv.keys + ((l * kv.kv_heads + kvh) * ((kv.capacity + 15) >> 4) + (pos >> 4)) * kv.head_dim * 16 * kv.esize
    return kv.keys + (((l * kv.kv_heads + kvh) * kv.nblocks + kv.blocks[pos >> 4]) * kv.head_dim * 16) * kv.esize


cdef inline char *v_row(const KV *kv, size_t l, size_t kvh, size_t pos) noexcept nogil:
    """KV head kvh's value at position pos (head_dim elements); the next
    position's (in the same page) starts v_stride(kv) elements on."""
    if kv.blocks == NULL:
        return kv.values + ((l * kv.kv_heads + kvh) * kv.capacity + pos) * kv.head_dim * kv.esize
    return kv.values + ((((l * kv.kv_heads + kvh) * kv.nblocks + kv.blocks[pos >> 4]) * 16 + (pos & 15))
                        * kv.head_dim * kv.esize)


cdef inline size_t v_stride(const KV *kv) noexcept nogil:
    return kv.head_dim


cdef inline size_t key_run(const KV *kv, size_t pos, size_t end) noexcept nogil:
    """How many positions from pos (< end) sit in consecutive cache rows
    (in pages: up to the next block that does not follow its predecessor)."""
    cdef size_t b, n
    if kv.blocks == NULL:
        return end - pos
    b = pos >> 4
    n = 16 - (pos & 15)
    while pos + n < end and kv.blocks[b + 1] == kv.blocks[b] + 1:
        b += 1
        n += 16
    return min(n, end - pos)


cdef inline void prefetch_lines(const char *p, size_t n, size_t stride, size_t rows) noexcept nogil:
    """Ask for rows of n bytes, stride apart, one cache line at a time."""
    cdef size_t r, i
    for r in range(rows):
        i = 0
        while i < n:
            __builtin_prefetch(p + r * stride + i, 0, 3)
            i += 64


cdef inline void kv_scores(const cism_kernels *K, const KV *kv, const float *q, size_t ldq, size_t nq,
                           size_t l, size_t kvh, size_t hd, float *sc, size_t lds, size_t span,
                           size_t t0, size_t t1, bint bf16=False) noexcept nogil:
    """sc[i * lds + tau] = score of query i against KV head kvh's key at
    position tau, for the key tiles t0..t1 - 1 (positions below span); bf16:
    the bf16 prefill's scores (K.scores16_bf16, not NULL). In
    pages the next tile is fetched while this one is scored (pages are
    scattered: the hardware prefetcher does not follow the block table)."""
    cdef size_t t, nk
    for t in range(t0, t1):
        if kv.blocks != NULL and t + 1 < t1 and kv.blocks[t + 1] != kv.blocks[t] + 1:
            prefetch_lines(k_tile(kv, l, kvh, 16 * (t + 1)), hd * 16 * kv.esize, 0, 1)
        nk = min(span - 16 * t, <size_t>16)
        if bf16 and kv.esize == 2:
            K.scores16_bf16_h(q, ldq, nq, <const uint16_t*>k_tile(kv, l, kvh, 16 * t), hd, sc + 16 * t, lds, nk)
        elif bf16:
            K.scores16_bf16(q, ldq, nq, <const float*>k_tile(kv, l, kvh, 16 * t), hd, sc + 16 * t, lds, nk)
        elif kv.esize == 2:
            K.scores16_h(q, ldq, nq, <const uint16_t*>k_tile(kv, l, kvh, 16 * t), hd, sc + 16 * t, lds, nk)
        else:
            K.scores16(q, ldq, nq, <const float*>k_tile(kv, l, kvh, 16 * t), hd, sc + 16 * t, lds, nk)


cdef inline void kv_weighted(const cism_kernels *K, const KV *kv, const float *P, size_t ldp, size_t nq,
                             size_t l, size_t kvh, size_t start, size_t end, size_t c0, float *O, size_t ldo,
                             size_t n, bint bf16=False) noexcept nogil:
    """O[i] = fma(P[i * ldp + tau], value at position tau, O[i]) for the
    positions start..end - 1 in order, n elements from c0 of KV head kvh's
    values, by runs of consecutive cache rows: axpy_tile's chain (plain axpy
    calls' bits). bf16: K.axpy_tile_bf16's chain over key pairs instead
    (start even: every run then starts even, pages being 16 positions)."""
    cdef size_t tau = start, run
    while tau < end:
        run = key_run(kv, tau, end)
        if kv.blocks != NULL and tau + run < end:
            # the next page's rows of these columns, while this page's are summed
            prefetch_lines(v_row(kv, l, kvh, tau + run) + c0 * kv.esize, n * kv.esize,
                           kv.head_dim * kv.esize, min(end - tau - run, <size_t>16))
        if bf16 and kv.esize == 2:
            K.axpy_tile_bf16_h(P + tau, ldp, nq, <const uint16_t*>v_row(kv, l, kvh, tau) + c0, v_stride(kv), run,
                               O, ldo, n)
        elif bf16:
            K.axpy_tile_bf16(P + tau, ldp, nq, <const float*>v_row(kv, l, kvh, tau) + c0, v_stride(kv), run,
                             O, ldo, n)
        elif kv.esize == 2:
            K.axpy_tile_h(P + tau, ldp, nq, <const uint16_t*>v_row(kv, l, kvh, tau) + c0, v_stride(kv), run,
                          O, ldo, n)
        else:
            K.axpy_tile(P + tau, ldp, nq, <const float*>v_row(kv, l, kvh, tau) + c0, v_stride(kv), run,
                        O, ldo, n)
        tau += run


cdef inline void kv_store(const cism_kernels *K, const KV *kv, size_t l, size_t kvh, size_t pos,
                          const float *k, const float *v) noexcept nogil:
    """KV head kvh's key k and value v (head_dim floats each) at position
    pos: the key into its tile's lane, both rounded to binary16 (to_f16)
    in an fp16 cache."""
    cdef size_t j, hd = kv.head_dim
    cdef float *tile
    if kv.esize == 2:
        K.to_f16(k, hd, <uint16_t*>k_tile(kv, l, kvh, pos) + (pos & 15), 16)
        K.to_f16(v, hd, <uint16_t*>v_row(kv, l, kvh, pos), 1)
    else:
        tile = <float*>k_tile(kv, l, kvh, pos) + (pos & 15)
        for j in range(hd):
            tile[j * 16] = k[j]
        memcpy(v_row(kv, l, kvh, pos), v, hd * sizeof(float))
