/* A flag one thread sets (cancel) while another polls it inside compute.
 *
 * 0 = running, 1 = cancelled. A negative value -n arms a countdown, which
 * only tests use (a session's _cancel_after(n)): the n-th check made by the
 * compute itself turns the flag into a cancel, so every point where a run
 * can stop is reached on purpose, not by the luck of thread timing. Status
 * reads (cism_flag_get) count nothing and see an armed flag as running. */
#ifndef CISM_FLAG_H
#define CISM_FLAG_H
static inline int cism_flag_get(const int *p) { return __atomic_load_n(p, __ATOMIC_RELAXED) > 0; }
static inline void cism_flag_set(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

/* A cancellation point: is the run cancelled (counting one check of an armed flag)? */
static inline int cism_flag_check(int *p) {
    int v = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (v < 0) {   /* armed: count this check (a concurrent cancel() wins the race) */
        const int next = v + 1 == 0 ? 1 : v + 1;
        if (__atomic_compare_exchange_n(p, &v, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return next > 0;
    }
    return v > 0;
}
#endif
