/* Packing float32 rows into the formats of formats.h (rules written there). */
#ifndef CISM_PACK_H
#define CISM_PACK_H

#include "formats.h"

/* Pack rows [r0, r1) of a (rows, cols) float32 array into the buffers of a
 * matrix of the given storage (row_scales: int8 only). Rows are independent, so callers may pack
 * disjoint ranges on different threads. */
void cism_pack_rows(int storage, const float *values, size_t cols, size_t r0, size_t r1,
                    void *codes, float *row_scales);

/* Zeroed memory for packed weights: 64-byte aligned, at least nbytes plus
 * CISM_SLACK bytes. From 2 MiB on (or a little less: the size is then
 * rounded up to whole 2 MiB pages, at most 1/8 more) it is 2 MiB aligned
 * and asked of Linux as transparent huge pages (madvise), so decode's row
 * streams walk a few TLB entries instead of one per 4 KiB; the untouched
 * alignment gap costs address space only. CISM_HUGE_PAGES=0 keeps 4 KiB
 * pages. Free with free(); NULL when memory is short. */
void *cism_alloc_weights(size_t nbytes);

/* Row r back to floats as the kernels see it (int8 multiplied by its row scale). */
void cism_unpack_row(const cism_mat *W, size_t r, float *out);

#endif
