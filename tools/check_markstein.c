/* Checks the softmax's division-free quotient (csrc/act/act_avx512.c,
 * weight16) against vdivps on random pairs: x in [2^-100, 1], sum in
 * [1, 2^21), a quarter of them with special significands (all ones, all
 * ones but the last, zero). Prints the pairs that differ.
 *
 *   gcc -O2 -mavx512f -mfma tools/check_markstein.c -o /tmp/check && /tmp/check 200000000
 *
 * (16 x the argument pairs; 200000000 took 6 s and found none.) */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

int main(int argc, char **argv) {
    const long n = argc > 1 ? atol(argv[1]) : 1000000;
    uint64_t state = 88172645463325252ull;
    long differ = 0, tested = 0;
    for (long it = 0; it < n; it += 16) {
        uint32_t xs[16], ss[16];
        for (int l = 0; l < 16; l++) {
            const uint64_t r = next(&state);
            uint32_t mx = r & 0x7fffff, ms = (r >> 23) & 0x7fffff;
            switch ((r >> 46) & 7) {
            case 0: ms = 0x7fffff; break;
            case 1: mx = 0x7fffff; break;
            case 2: ms = 0x7ffffe; break;
            case 3: mx = 0; break;
            default: break;
            }
            const uint32_t ex = 127 - (uint32_t)((r >> 50) % 101), es = 127 + (uint32_t)((r >> 58) % 21);
            xs[l] = ex << 23 | mx;
            ss[l] = es << 23 | ms;
            if (xs[l] > 0x3f800000) xs[l] = 0x3f800000; /* x <= 1 */
        }
        const __m512 x = _mm512_loadu_ps((const float *)xs);
        for (int l = 0; l < 16; l++) {
            float sv;
            memcpy(&sv, &ss[l], 4);
            const __m512 sum = _mm512_set1_ps(sv);
            const __m512 y = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
            const __m512 q = _mm512_mul_ps(x, y);
            const __m512 got = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, sum, x), y, q);
            const __m512 want = _mm512_div_ps(x, sum);
            const __mmask16 ne = _mm512_cmp_epi32_mask(_mm512_castps_si512(got), _mm512_castps_si512(want),
                                                       _MM_CMPINT_NE);
            tested += 16;
            for (int i = 0; i < 16; i++)
                if (ne >> i & 1) {
                    float xv;
                    memcpy(&xv, &xs[i], 4);
                    if (differ++ < 10) printf("differs: x=%a sum=%a\n", xv, sv);
                }
        }
    }
    printf("tested %ld pairs, %ld differ\n", tested, differ);
    return differ != 0;
}
