/* The tile unit's configuration, shared by the amx level's kernel files
 * (gemm/gemm_amx.c: bf16; gemm_q8/gemm_q8_amx.c: int8 x q8). */
#ifndef CISM_SIMD_AMX_H
#define CISM_SIMD_AMX_H

#include "simd_avx512.h"

/* A tile configuration (palette 1): tile t has rows[t] rows of colsb[t]
 * bytes. Fill it through a volatile object: GCC 12 at -O3 drops the stores
 * that fill a plain struct before _tile_loadconfig reads it (NOTES.md); a
 * barrier before the load keeps them in order. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#endif
