/* Reading weight memory on purpose: touch() refreshes residency byte by
 * byte (volatile, cannot be elided); scan() streams cache lines as fast as
 * the memory allows (for bandwidth probes). Both return a sink value so the
 * reads cannot be optimised away. */
#ifndef CISM_MEMSCAN_H
#define CISM_MEMSCAN_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

static inline uint64_t cism_touch(const void *p, size_t n) {
    const volatile uint8_t *b = (const volatile uint8_t *)p;
    uint64_t sink = 0;
    for (size_t i = 0; i < n; i += 64) sink += b[i]; /* one read per cache line */
    if (n) sink += b[n - 1];
    return sink;
}

/* One cache line per step, as four 16-byte loads where SSE2 exists (every
 * x86-64): on a Zen 3 host the 8-byte scalar loop was the limit, reading
 * 5-8 GB/s per thread in 512-byte steps where these loads read 11-15 and
 * the fp32 gemv streams 12-17, so rooflines came out above 100%. */
static inline uint64_t cism_scan(const void *p, size_t n) {
    const uint8_t *b = (const uint8_t *)p;
    uint64_t s = 0;
    size_t i = 0;
#ifdef __SSE2__
    __m128i v0 = _mm_setzero_si128(), v1 = v0, v2 = v0, v3 = v0;
    for (; i + 64 <= n; i += 64) {
        v0 = _mm_add_epi64(v0, _mm_loadu_si128((const __m128i *)(b + i)));
        v1 = _mm_add_epi64(v1, _mm_loadu_si128((const __m128i *)(b + i + 16)));
        v2 = _mm_add_epi64(v2, _mm_loadu_si128((const __m128i *)(b + i + 32)));
        v3 = _mm_add_epi64(v3, _mm_loadu_si128((const __m128i *)(b + i + 48)));
    }
    uint64_t w[2];
    memcpy(w, &v0, 16); s += w[0] + w[1];
    memcpy(w, &v1, 16); s += w[0] + w[1];
    memcpy(w, &v2, 16); s += w[0] + w[1];
    memcpy(w, &v3, 16); s += w[0] + w[1];
#else
    uint64_t s1 = 0, s2 = 0, s3 = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, b + i, 32);
        s += w[0]; s1 += w[1]; s2 += w[2]; s3 += w[3];
    }
    s += s1 + s2 + s3;
#endif
    for (; i < n; i++) s += b[i];
    return s;
}

/* Bytes [begin, end) of the concatenation of `count` regions (addresses
 * addr[i], sizes size[i]) read as `streams` (<= 16) interleaved sequential
 * streams (several DRAM streams per core are needed to reach the machine's
 * bandwidth), each
 * a contiguous part of the range, in 512-byte steps (64 to 4096 tried: 512
 * read fastest here): how a thread of a decode gemv reads its
 * share of the weights (streams far apart), so Model.scan measures what
 * decode can reach. */
static inline uint64_t cism_scan_regions(const size_t *addr, const size_t *size, size_t count,
                                         size_t begin, size_t end, size_t streams) {
    size_t reg[16], off[16], left[16];
    uint64_t sink = 0;
    if (streams < 1) streams = 1;
    if (streams > 16) streams = 16;
    if (end <= begin || count == 0) return 0;
    for (size_t s = 0; s < streams; s++) {
        const size_t a = begin + (end - begin) * s / streams, b = begin + (end - begin) * (s + 1) / streams;
        size_t r = 0, base = 0;
        while (r + 1 < count && base + size[r] <= a) base += size[r++];
        reg[s] = r;
        off[s] = a - base;
        left[s] = b - a;
    }
    for (int active = 1; active;) {
        active = 0;
        for (size_t s = 0; s < streams; s++) {
            if (!left[s]) continue;
            while (off[s] >= size[reg[s]]) { off[s] = 0; reg[s]++; } /* next region */
            size_t n = size[reg[s]] - off[s];
            if (n > 512) n = 512;
            if (n > left[s]) n = left[s];
            sink += cism_scan((const void *)(addr[reg[s]] + off[s]), n);
            off[s] += n;
            left[s] -= n;
            active = 1;
        }
    }
    return sink;
}
#endif
