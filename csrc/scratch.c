/* Per-thread kernel scratch: see scratch.h. */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include "scratch.h"

#include <pthread.h>
#include <stdlib.h>

typedef struct {
    void *p;
    size_t n;
    int busy;
} scratch_slot;

static pthread_key_t slot_key;
static pthread_once_t slot_once = PTHREAD_ONCE_INIT;
static int slot_key_ok;
static int failures; /* gets still to refuse (tests) */

static void slot_free(void *v) {
    scratch_slot *s = v;
    free(s->p);
    free(s);
}

static void slot_init(void) { slot_key_ok = pthread_key_create(&slot_key, slot_free) == 0; }

/* This thread's slot, created on first use; NULL without memory. */
static scratch_slot *slot(void) {
    pthread_once(&slot_once, slot_init);
    if (!slot_key_ok) return NULL;
    scratch_slot *s = pthread_getspecific(slot_key);
    if (s) return s;
    s = calloc(1, sizeof *s);
    if (s && pthread_setspecific(slot_key, s) != 0) {
        free(s);
        s = NULL;
    }
    return s;
}

/* Under AddressSanitizer every get is a buffer of exactly its size, so the
 * sanitizer sees a kernel that overruns its scratch (a kept buffer, sized
 * for an earlier and larger call, would hide it). */
#if defined(__SANITIZE_ADDRESS__)
#define KEEP_SCRATCH 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KEEP_SCRATCH 0
#endif
#endif
#ifndef KEEP_SCRATCH
#define KEEP_SCRATCH 1
#endif

static void *fresh(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, bytes) == 0 ? p : NULL;
}

void *cism_scratch_get(size_t bytes) {
    if (__atomic_load_n(&failures, __ATOMIC_RELAXED) > 0 &&
        __atomic_sub_fetch(&failures, 1, __ATOMIC_RELAXED) >= 0)
        return NULL;
    if (bytes == 0) bytes = 1;
    scratch_slot *s = KEEP_SCRATCH ? slot() : NULL;
    if (!KEEP_SCRATCH || !s || s->busy || bytes > CISM_SCRATCH_KEEP) return fresh(bytes);
    if (bytes > s->n) {
        /* replaced, not realloc'ed: nothing in it needs keeping, and a failed
         * grow leaves the slot empty rather than claiming the old size */
        free(s->p);
        s->p = NULL;
        s->n = 0;
        const size_t n = (bytes + 4095) / 4096 * 4096;
        void *p = fresh(n);
        if (!p) return NULL;
        s->p = p;
        s->n = n;
    }
    s->busy = 1;
    return s->p;
}

void cism_scratch_put(void *p) {
    if (!p) return;
    scratch_slot *s = KEEP_SCRATCH ? slot() : NULL;
    if (s && s->busy && p == s->p) {
        s->busy = 0;
        return;
    }
    free(p);
}

int cism_scratch_fail(int n) {
    const int left = __atomic_exchange_n(&failures, n < 0 ? 0 : n, __ATOMIC_RELAXED);
    return left < 0 ? 0 : left;
}
