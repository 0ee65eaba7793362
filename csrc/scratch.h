/* Scratch memory for the multi-token kernels, kept per thread.
 *
 * A multi-token call (prefill, a batch's decode step) needs a few KiB to a
 * MiB of scratch: packed activations, unpacked weight rows, tile buffers.
 * Taking it from the heap on every call put malloc, free and, past glibc's
 * mmap threshold, fresh zeroed pages on the per-token path of a batch.
 * cism_scratch_get hands each thread one 64-byte aligned buffer instead,
 * grown when a call needs more than any before it and kept until the
 * thread ends (a destructor frees it), so a steady forward allocates
 * nothing. A request above CISM_SCRATCH_KEEP bytes (a Matrix.gemm of many
 * thousands of tokens) or one made while the thread's buffer is in use gets
 * a buffer of its own, freed by cism_scratch_put; every get is paired with
 * a put. NULL when memory cannot be had: each kernel then runs a path that
 * needs no scratch (same bits) or, for bf16, reports it.
 *
 * cism_scratch_fail(n) makes the next n gets (on any thread) return NULL,
 * so tests can drive those fallbacks deliberately; it returns how many
 * refusals the previous call had left unspent. */
#ifndef CISM_SCRATCH_H
#define CISM_SCRATCH_H

#include <stddef.h>

#define CISM_SCRATCH_KEEP ((size_t)8 << 20)

void *cism_scratch_get(size_t bytes);
void cism_scratch_put(void *p);
int cism_scratch_fail(int n);

#endif
