/* Token selection: the spec's sampler bit for bit, and the prompt-lookup drafter. */
#ifndef CISM_SAMPLE_H
#define CISM_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"  /* cism_argmax_fn, cism_argmax_scan */

/* std::mt19937_64, exactly (seed 5489 -> first output 14514284786278117030). */
typedef struct {
    uint64_t mt[312];
    size_t index;
} cism_mt64;

void cism_mt64_seed(cism_mt64 *g, uint64_t seed);
uint64_t cism_mt64_next(cism_mt64 *g);

/* Scratch the sampler reuses between calls (one per session/sequence). */
typedef struct {
    uint64_t *keys, *tmp;
    double *probs;
    float *work;     /* penalised logits (knobs path only) */
    size_t cap, work_cap;
} cism_sampler;

/* The sampling settings of a session. min_p = 0 and repetition_penalty = 1
 * leave the spec's sampler untouched (bit for bit). */
typedef struct {
    double temperature, top_p;
    size_t top_k;
    double min_p;               /* keep tokens with p >= min_p * p_max (0 = off) */
    double repetition_penalty;  /* HF rule on tokens already seen (1 = off) */
} cism_knobs;

void cism_sampler_free(cism_sampler *s);

/* First index of the largest logit (std::max_element), through the kernel
 * table's argmax once cism_sample_use_argmax has been given its slot (the
 * table is refilled in place when the ISA level changes, so the slot
 * follows it). */
void cism_sample_use_argmax(cism_argmax_fn const *slot);
size_t cism_argmax(const float *logits, size_t n);

/* The spec's sampler: temperature 0 -> argmax; otherwise order tokens by
 * logit (descending, ties by ascending index), keep top_k (0 = all), take
 * probabilities exp((l - max)/temperature) in double, cut the nucleus at
 * top_p * total, and walk it with one draw (rng >> 11) * 2^-53 * total.
 * Returns the token, or -1 when scratch memory cannot be allocated. */
int64_t cism_sample(const float *logits, size_t vocab, double temperature, double top_p,
                    size_t top_k, cism_mt64 *rng, cism_sampler *s);

/* cism_sample with the extra knobs: the repetition penalty divides positive
 * (multiplies negative) logits of every token in history; min_p keeps the
 * tokens whose logit is at least max + temperature * log(min_p) (applied as a
 * tighter top_k, so the order and arithmetic of the sampler stay the
 * spec's). Returns the token or -1 (no memory). */
int64_t cism_choose(const float *logits, size_t vocab, const cism_knobs *k, const int64_t *history,
                    size_t n_history, cism_mt64 *rng, cism_sampler *s);

/* Log-probabilities under the raw logits (the model's distribution before
 * temperature and the knobs): lse = max + log(sum exp(l - max)), the sum in
 * double in index order; returns log p(token) = l[token] - lse. With top_n >
 * 0 it also writes the top_n most likely tokens (ties: lower index first)
 * and their log-probabilities, most likely first. */
double cism_logprobs(const float *logits, size_t vocab, int64_t token, size_t top_n,
                     int64_t *top_ids, double *top_lp);

/* Prompt-lookup drafter (spec v4): for each draft position take the longest
 * trailing n-gram (n <= 3) of history + draft so far and emit the token that
 * followed its most recent occurrence strictly inside the history; stop when
 * there is none. Writes at most k tokens to out; returns how many. */
size_t cism_draft(const int64_t *history, size_t n, size_t k, int64_t *out);

#endif
