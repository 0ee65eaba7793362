/* Packing float32 rows into the formats of formats.h (rules written there). */
#ifndef CISM_PACK_H
#define CISM_PACK_H

#include "formats.h"

/* Pack rows [r0, r1) of a (rows, cols) float32 array into the buffers of a
 * matrix of the given storage (row_scales: int8 only). Rows are independent, so callers may pack
 * disjoint ranges on different threads. */
void cism_pack_rows(int storage, const float *values, size_t cols, size_t r0, size_t r1,
                    void *codes, float *row_scales);

/* Row r back to floats as the kernels see it (int8 multiplied by its row scale). */
void cism_unpack_row(const cism_mat *W, size_t r, float *out);

#endif
