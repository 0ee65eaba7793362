/* Reading weight memory on purpose: touch() refreshes residency byte by
 * byte (volatile, cannot be elided); scan() streams 8-byte words as fast as
 * the memory allows (for bandwidth probes). Both return a sink value so the
 * reads cannot be optimised away. */
#ifndef CISM_MEMSCAN_H
#define CISM_MEMSCAN_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t cism_touch(const void *p, size_t n) {
    const volatile uint8_t *b = (const volatile uint8_t *)p;
    uint64_t sink = 0;
    for (size_t i = 0; i < n; i += 64) sink += b[i]; /* one read per cache line */
    if (n) sink += b[n - 1];
    return sink;
}

static inline uint64_t cism_scan(const void *p, size_t n) {
    const uint8_t *b = (const uint8_t *)p;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, b + i, 32);
        s0 += w[0]; s1 += w[1]; s2 += w[2]; s3 += w[3];
    }
    for (; i < n; i++) s0 += b[i];
    return s0 + s1 + s2 + s3;
}

/* Read n bytes as `streams` interleaved sequential streams (the way a
 * multi-row gemv reads): several DRAM streams per core are needed to reach
 * the machine's bandwidth. */
static inline uint64_t cism_scan_streams(const void *p, size_t n, size_t streams) {
    const uint8_t *b = (const uint8_t *)p;
    const size_t part = (n / streams) & ~(size_t)31;
    uint64_t sink = 0;
    for (size_t off = 0; off < part; off += 256) {
        const size_t len = part - off < 256 ? part - off : 256;
        for (size_t s = 0; s < streams; s++) sink += cism_scan(b + s * part + off, len);
    }
    if (part * streams < n) sink += cism_scan(b + part * streams, n - part * streams);
    return sink;
}
#endif
