# Causal GQA attention over a KV cache by query tiles (cimport
# cism._attention; the dense layers and Surjo's XSA steps). nq queries at
# consecutive positions p0.. of one sequence; every query gets exactly the
# arithmetic of attending alone, position by position (docs/EXACTNESS.md):
# its scores are canonical dots (scores16 over the key tiles: the fp32
# gemm's bits for each key) times the scale; then max, exp, one sum in
# position order, each weight score / sum; then out = fma(weight, value,
# out) over the positions in order (axpy_tile).
from libc.math cimport sqrtf
from libc.stdlib cimport free, realloc
from libc.string cimport memset
from cism._kernels cimport cism_kernels
from cism._kvcache cimport KV, kv_scores, kv_weighted
from cism._layers cimport all_finite_f, grow_f
from cism.matrix cimport Scratch, scratch_free
from cism._status cimport cism_flag_set

cdef enum:
    QTILE = 16   # queries attended together (scores16 takes them four at a time)


cdef struct AttnWork:
    # token-major scratch of an attention family's forward, up to tokens_cap tokens
    float *x        # (T, hidden) residual stream
    float *xn       # (T, hidden) normalized
    float *q        # (T, q_width)
    float *k        # (T, kv_width)
    float *v        # (T, kv_width)
    float *att      # (T, q_width)
    float *proj     # (T, hidden) mixer / MLP output
    float *gate     # (T, inter)
    float *up       # (T, inter)
    float *head_in  # (n_out, hidden) final-normed rows that need logits
    float *scores   # (threads, QTILE * score_cap) one query tile's scores per thread
    float *rope     # (threads, head_dim) cos/sin beyond the table
    int *seq_of     # (T,) sequence of each token
    size_t *pos_of  # (T,) position of each token
    size_t *out_rows  # (n_out,) the tokens whose logits are wanted, in row order
    size_t *tile_of # (T,) first token of each attention query tile
    size_t tokens_cap, score_cap, out_cap, threads_cap
    int bad_score   # set (atomically, by any thread) when an attention score is not finite
    Scratch qs


cdef inline int attn_work_reserve(AttnWork *w, size_t T, size_t S, size_t n_out, size_t hidden, size_t inter,
                                  size_t q_width, size_t kv_width, size_t head_dim, size_t nt) noexcept nogil:
    """Room for T tokens over S positions, n_out logits rows and nt threads:
    0, or -1 without memory. A cap is zeroed before its buffers are
    replaced, so a failed grow leaves nothing that a later, smaller call
    could mistake for room."""
    if T > w.tokens_cap:
        w.tokens_cap = 0
        if (grow_f(&w.x, T * hidden) or grow_f(&w.xn, T * hidden) or grow_f(&w.q, T * q_width)
                or grow_f(&w.k, T * kv_width) or grow_f(&w.v, T * kv_width)
                or grow_f(&w.att, T * q_width) or grow_f(&w.proj, T * hidden)
                or grow_f(&w.gate, T * inter) or grow_f(&w.up, T * inter)):
            return -1
        w.seq_of = <int*>realloc(w.seq_of, T * sizeof(int))
        w.pos_of = <size_t*>realloc(w.pos_of, T * sizeof(size_t))
        w.out_rows = <size_t*>realloc(w.out_rows, T * sizeof(size_t))
        w.tile_of = <size_t*>realloc(w.tile_of, T * sizeof(size_t))
        if w.seq_of == NULL or w.pos_of == NULL or w.out_rows == NULL or w.tile_of == NULL:
            return -1
        w.tokens_cap = T
    if n_out > w.out_cap:
        w.out_cap = 0
        if grow_f(&w.head_in, n_out * hidden):
            return -1
        w.out_cap = n_out
    if S > w.score_cap or nt > w.threads_cap:
        w.score_cap = 0
        w.threads_cap = 0
        if grow_f(&w.scores, nt * QTILE * S) or grow_f(&w.rope, nt * head_dim):
            return -1
        w.score_cap = S
        w.threads_cap = nt
    return 0


cdef inline void attn_work_free(AttnWork *w) noexcept nogil:
    free(w.x); free(w.xn); free(w.q); free(w.k); free(w.v); free(w.att); free(w.proj)
    free(w.gate); free(w.up); free(w.head_in); free(w.scores); free(w.rope)
    free(w.seq_of); free(w.pos_of); free(w.out_rows); free(w.tile_of)
    scratch_free(&w.qs)
    memset(w, 0, sizeof(AttnWork))


cdef inline size_t query_tiles(size_t *tile_of, const int *seq_of, const size_t *pos_of,
                               size_t T) noexcept nogil:
    """Cut T tokens into runs of up to QTILE tokens of one sequence at
    consecutive positions (a prompt chunk gives full tiles, a batch of
    single decode tokens tiles of one); tile_of[i] = first token of tile i.
    Returns the number of tiles."""
    cdef size_t g, n = 0
    for g in range(T):
        if (n == 0 or g - tile_of[n - 1] == QTILE or seq_of[g] != seq_of[g - 1]
                or pos_of[g] != pos_of[g - 1] + 1):
            tile_of[n] = g
            n += 1
    return n


cdef inline size_t window_start(size_t window, size_t p) noexcept nogil:
    """The first position a query at position p attends to: 0, or the
    start of its sliding window (Mistral: the last `window` positions,
    itself included, as transformers masks them; window 0: no window)."""
    return p + 1 - window if window and p + 1 > window else 0


cdef inline void tile_softmax(const cism_kernels *K, float *sc, size_t ldsc, size_t nq, size_t p0,
                              float scale, float *out, size_t ldo, size_t hd, int *bad) noexcept nogil:
    """Row i of sc (positions 0..p0 + i) becomes the weights of query i
    (K.softmax: times scale, minus the maximum, exp, each divided by the
    sum, the maximum and the sum by 16 lanes and the canonical tree).
    Zeroes each query's output row (hd floats). A row holding a non-finite
    score sets bad[0] (the spec's "non-finite attention score"; the scale
    is positive and at most 1, so the unscaled dots are finite exactly when
    the scaled ones are)."""
    cdef size_t i
    for i in range(nq):
        if not all_finite_f(sc + i * ldsc, p0 + i + 1):
            cism_flag_set(bad, 1)
        K.softmax(sc + i * ldsc, p0 + i + 1, scale)
        memset(out + i * ldo, 0, hd * sizeof(float))


cdef inline void window_softmax(const cism_kernels *K, float *row, size_t lo, size_t p, float scale,
                                float *out, size_t hd, int *bad) noexcept nogil:
    """tile_softmax for one query at position p over positions lo..p of its
    score row (lo = 0: tile_softmax's bits, and its check of the scores it
    reads); zeroes its output."""
    if not all_finite_f(row + lo, p + 1 - lo):
        cism_flag_set(bad, 1)
    K.softmax(row + lo, p + 1 - lo, scale)
    memset(out, 0, hd * sizeof(float))


cdef inline void attend_tile(const cism_kernels *K, const KV *kv, size_t l, size_t kvh, const float *q,
                             float *out, size_t ld, size_t nq, size_t p0, size_t window,
                             float *sc, int *bad, bint bf16=False) noexcept nogil:
    """One head's causal attention for a tile of nq queries at positions
    p0.. (q and out: nq rows ld floats apart), over KV head kvh of layer l:
    the tile for the positions every query sees, each query alone for the
    rest; where a sliding window cuts in, each query over its own positions
    (the tile's split gives each query these bits too, axpy_tile's chain
    being plain axpy's). sc: QTILE rows of at least p0 + nq scores; bad:
    the flag a non-finite score sets (AttnWork.bad_score). bf16 (no
    window): the bf16 prefill's scores and sums (K.scores16_bf16 and
    K.axpy_tile_bf16, not NULL), their key pairs cut the same for every
    query whatever the tile: the tile up to the last even position all of
    its queries see, each query alone from there."""
    cdef size_t hd = kv.head_dim, span = p0 + nq, i, lo, e0
    cdef float scale = 1.0 / sqrtf(<float>hd)
    bf16 = bf16 and window == 0
    kv_scores(K, kv, q, ld, nq, l, kvh, hd, sc, span, span, window_start(window, p0) // 16, (span + 15) // 16,
              bf16)
    if bf16:
        tile_softmax(K, sc, span, nq, p0, scale, out, ld, hd, bad)
        e0 = (p0 + 1) & ~(<size_t>1)
        kv_weighted(K, kv, sc, span, nq, l, kvh, 0, e0, 0, out, ld, hd, True)
        for i in range(nq):
            kv_weighted(K, kv, sc + i * span, span, 1, l, kvh, e0, p0 + i + 1, 0, out + i * ld, ld, hd, True)
    elif window_start(window, span - 1) == 0:
        tile_softmax(K, sc, span, nq, p0, scale, out, ld, hd, bad)
        kv_weighted(K, kv, sc, span, nq, l, kvh, 0, p0 + 1, 0, out, ld, hd)
        for i in range(1, nq):
            kv_weighted(K, kv, sc + i * span, span, 1, l, kvh, p0 + 1, p0 + i + 1, 0, out + i * ld, ld, hd)
    else:
        for i in range(nq):
            lo = window_start(window, p0 + i)
            window_softmax(K, sc + i * span, lo, p0 + i, scale, out + i * ld, hd, bad)
            kv_weighted(K, kv, sc + i * span, span, 1, l, kvh, lo, p0 + i + 1, 0, out + i * ld, ld, hd)


cdef inline void attend_group(const cism_kernels *K, const KV *kv, size_t l, size_t kvh, const float *q,
                              float *out, size_t G, size_t p, size_t window, float *sc,
                              int *bad, bint bf16=False) noexcept nogil:
    """Attention of one lone query at position p for the G heads that share
    KV head kvh (q and out: the group's first head, heads head_dim apart),
    up to QTILE of them at a time as one tile of queries over the same keys
    and values: scores16 gives each query the dots it gets alone and
    axpy_tile each output the fma chain of plain axpy calls
    (csrc/kernels.h), so every head gets exactly attend_tile's arithmetic
    for it alone; the tile reads each key and value once for the heads and
    gives the weighted sums several independent chains. bf16: as
    attend_tile's (no window)."""
    cdef size_t hd = kv.head_dim, span = p + 1, t, h0, nh, j, lo = window_start(window, p)
    bf16 = bf16 and window == 0
    for t in range((G + QTILE - 1) // QTILE):
        h0 = t * QTILE
        nh = min(<size_t>QTILE, G - h0)
        kv_scores(K, kv, q + h0 * hd, hd, nh, l, kvh, hd, sc, span, span, lo // 16, (span + 15) // 16, bf16)
        for j in range(nh):
            window_softmax(K, sc + j * span, lo, p, 1.0 / sqrtf(<float>hd), out + (h0 + j) * hd, hd, bad)
        kv_weighted(K, kv, sc, span, nh, l, kvh, lo, span, 0, out + h0 * hd, hd, hd, bf16)
