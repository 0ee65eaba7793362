/* Token selection. Portable C, no ISA flags: the sampler must choose the same
 * token on every machine, so it follows the spec's operations exactly
 * (double arithmetic in a fixed order) and only the sort is our own: any
 * correct sort gives the same order because the order is total (logit
 * descending, then index ascending). */
#include "sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MT_N 312
#define MT_M 156
#define MT_UPPER 0xFFFFFFFF80000000ULL
#define MT_LOWER 0x7FFFFFFFULL

void cism_mt64_seed(cism_mt64 *g, uint64_t seed) {
    g->mt[0] = seed;
    for (size_t i = 1; i < MT_N; i++)
        g->mt[i] = 6364136223846793005ULL * (g->mt[i - 1] ^ (g->mt[i - 1] >> 62)) + i;
    g->index = MT_N;
}

uint64_t cism_mt64_next(cism_mt64 *g) {
    if (g->index >= MT_N) {
        for (size_t i = 0; i < MT_N; i++) {
            const uint64_t x = (g->mt[i] & MT_UPPER) | (g->mt[(i + 1) % MT_N] & MT_LOWER);
            uint64_t xa = x >> 1;
            if (x & 1) xa ^= 0xB5026F5AA96619E9ULL;
            g->mt[i] = g->mt[(i + MT_M) % MT_N] ^ xa;
        }
        g->index = 0;
    }
    uint64_t y = g->mt[g->index++];
    y ^= (y >> 29) & 0x5555555555555555ULL;
    y ^= (y << 17) & 0x71D67FFFEDA60000ULL;
    y ^= (y << 37) & 0xFFF7EEE000000000ULL;
    y ^= y >> 43;
    return y;
}

void cism_sampler_free(cism_sampler *s) {
    free(s->keys);
    free(s->tmp);
    free(s->probs);
    free(s->work);
    memset(s, 0, sizeof *s);
}

/* The kernel table's argmax (every level gives the reference's index),
 * set once by cism.sampling at import; the scalar rule until then. */
static cism_argmax_fn const *argmax_slot = NULL;

void cism_sample_use_argmax(cism_argmax_fn const *slot) { argmax_slot = slot; }

size_t cism_argmax(const float *logits, size_t n) {
    if (argmax_slot && *argmax_slot) return (*argmax_slot)(logits, n);
    return cism_argmax_scan(logits, 1, n, 0);
}

/* Sort key: ascending key = descending logit, then ascending index. -0 and
 * +0 compare equal in the spec, so both map to the key of +0. */
static inline uint64_t order_key(float logit, size_t index, unsigned index_bits) {
    uint32_t u;
    if (logit == 0.0f) logit = 0.0f;
    memcpy(&u, &logit, 4);
    const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)(~ascending) << index_bits) | index;
}

/* LSD radix sort of n keys using the low `bits` bits, 11 bits per pass. */
static uint64_t *radix_sort(uint64_t *keys, uint64_t *tmp, size_t n, unsigned bits) {
    size_t count[2048];
    for (unsigned shift = 0; shift < bits; shift += 11) {
        memset(count, 0, sizeof count);
        for (size_t i = 0; i < n; i++) count[(keys[i] >> shift) & 2047]++;
        size_t sum = 0;
        for (size_t d = 0; d < 2048; d++) {
            const size_t c = count[d];
            count[d] = sum;
            sum += c;
        }
        for (size_t i = 0; i < n; i++) tmp[count[(keys[i] >> shift) & 2047]++] = keys[i];
        uint64_t *swap = keys;
        keys = tmp;
        tmp = swap;
    }
    return keys;
}

/* Smallest k keys in ascending order (k much smaller than n): a max-heap. */
static void heap_sift_down(uint64_t *h, size_t k, size_t i) {
    for (;;) {
        size_t l = 2 * i + 1, big = i;
        if (l < k && h[l] > h[big]) big = l;
        if (l + 1 < k && h[l + 1] > h[big]) big = l + 1;
        if (big == i) return;
        const uint64_t t = h[i];
        h[i] = h[big];
        h[big] = t;
        i = big;
    }
}

static void smallest_k(const uint64_t *keys, size_t n, size_t k, uint64_t *out) {
    memcpy(out, keys, k * sizeof *out);
    for (size_t i = k / 2; i-- > 0;) heap_sift_down(out, k, i);
    for (size_t i = k; i < n; i++)
        if (keys[i] < out[0]) {
            out[0] = keys[i];
            heap_sift_down(out, k, 0);
        }
    for (size_t end = k; end-- > 1;) { /* heap sort: ascending */
        const uint64_t t = out[0];
        out[0] = out[end];
        out[end] = t;
        heap_sift_down(out, end, 0);
    }
}

int64_t cism_sample(const float *logits, size_t vocab, double temperature, double top_p,
                    size_t top_k, cism_mt64 *rng, cism_sampler *s) {
    if (temperature == 0.0) return (int64_t)cism_argmax(logits, vocab);
    if (s->cap < vocab) {
        uint64_t *k = realloc(s->keys, vocab * sizeof *k);
        if (k) s->keys = k;
        uint64_t *t = realloc(s->tmp, vocab * sizeof *t);
        if (t) s->tmp = t;
        double *p = realloc(s->probs, vocab * sizeof *p);
        if (p) s->probs = p;
        if (!k || !t || !p) return -1;
        s->cap = vocab;
    }
    unsigned index_bits = 1;
    while (((size_t)1 << index_bits) < vocab) index_bits++;
    const uint64_t index_mask = ((uint64_t)1 << index_bits) - 1;
    for (size_t i = 0; i < vocab; i++) s->keys[i] = order_key(logits[i], i, index_bits);
    const size_t kept = top_k ? top_k : vocab;
    const uint64_t *order;
    if (kept * 16 < vocab) {
        smallest_k(s->keys, vocab, kept, s->tmp);
        order = s->tmp;
    } else {
        order = radix_sort(s->keys, s->tmp, vocab, 32 + index_bits);
    }
    double *prob = s->probs;
    const double maximum = logits[order[0] & index_mask];
    double total = 0;
    for (size_t i = 0; i < kept; i++) {
        prob[i] = exp(((double)logits[order[i] & index_mask] - maximum) / temperature);
        total += prob[i];
    }
    size_t nucleus = kept;
    if (top_p < 1) {
        double cumulative = 0;
        for (size_t i = 0; i < kept; i++) {
            cumulative += prob[i];
            if (cumulative >= top_p * total) {
                nucleus = i + 1;
                total = cumulative;
                break;
            }
        }
    }
    double target = (double)(cism_mt64_next(rng) >> 11) * 0x1.0p-53 * total;
    for (size_t i = 0; i < nucleus; i++) {
        if (target < prob[i]) return (int64_t)(order[i] & index_mask);
        target -= prob[i];
    }
    return (int64_t)(order[nucleus - 1] & index_mask);
}

int64_t cism_choose(const float *logits, size_t vocab, const cism_knobs *k, const int64_t *history,
                    size_t n_history, cism_mt64 *rng, cism_sampler *s) {
    const int penalise = k->repetition_penalty != 1.0;
    const int cut = k->min_p > 0.0 && k->temperature > 0.0;
    if (!penalise && !cut)
        return cism_sample(logits, vocab, k->temperature, k->top_p, k->top_k, rng, s);
    const float *z = logits;
    if (penalise) {
        if (s->work_cap < vocab) {
            float *w = realloc(s->work, vocab * sizeof *w);
            if (!w) return -1;
            s->work = w;
            s->work_cap = vocab;
        }
        memcpy(s->work, logits, vocab * sizeof(float));
        /* computed from the original logit, so repeats in history do not compound */
        const float rp = (float)k->repetition_penalty;
        for (size_t i = 0; i < n_history; i++) {
            const int64_t t = history[i];
            if (t < 0 || (size_t)t >= vocab) continue;
            const float l = logits[t];
            s->work[t] = l > 0.0f ? l / rp : l * rp;
        }
        z = s->work;
    }
    size_t top_k = k->top_k;
    if (cut) {
        const float m = z[cism_argmax(z, vocab)];
        const double threshold = (double)m + k->temperature * log(k->min_p);
        size_t keep = 0;
        for (size_t i = 0; i < vocab; i++) keep += (double)z[i] >= threshold;
        if (top_k == 0 || keep < top_k) top_k = keep;
    }
    return cism_sample(z, vocab, k->temperature, k->top_p, top_k, rng, s);
}

double cism_logprobs(const float *logits, size_t vocab, int64_t token, size_t top_n,
                     int64_t *top_ids, double *top_lp) {
    const float m = logits[cism_argmax(logits, vocab)];
    double sum = 0.0;
    for (size_t i = 0; i < vocab; i++) sum += exp((double)logits[i] - (double)m);
    const double lse = (double)m + log(sum);
    if (top_n > vocab) top_n = vocab;
    /* insertion into a sorted list of top_n: a later index replaces only a strictly larger logit */
    size_t have = 0;
    for (size_t i = 0; i < vocab && top_n; i++) {
        const float l = logits[i];
        if (have == top_n && !(l > logits[top_ids[have - 1]])) continue;
        size_t j = have < top_n ? have++ : have - 1;
        while (j > 0 && l > logits[top_ids[j - 1]]) {
            top_ids[j] = top_ids[j - 1];
            j--;
        }
        top_ids[j] = (int64_t)i;
    }
    for (size_t j = 0; j < top_n; j++) top_lp[j] = (double)logits[top_ids[j]] - lse;
    return (double)logits[token] - lse;
}

size_t cism_draft(const int64_t *history, size_t n, size_t k, int64_t *out) {
    size_t made = 0;
    if (k == 0 || n < 2) return 0;
    for (size_t j = 0; j < k; j++) {
        const size_t total = n + made;
        const size_t longest = total - 1 < 3 ? total - 1 : 3;
        int placed = 0;
        for (size_t pattern = longest; pattern >= 1 && !placed; pattern--) {
            /* an occurrence needs its continuation strictly inside history */
            if (pattern >= n) continue;
            for (size_t s = n - pattern; s-- > 0;) { /* most recent first */
                int match = 1;
                for (size_t o = 0; o < pattern && match; o++) {
                    const size_t pos = total - pattern + o;
                    const int64_t want = pos < n ? history[pos] : out[pos - n];
                    match = history[s + o] == want;
                }
                if (match) {
                    out[made++] = history[s + pattern];
                    placed = 1;
                    break;
                }
            }
        }
        if (!placed) break;
    }
    return made;
}
