/* The kernel families, their canonical arithmetic, and the dispatch table.
 *
 * Every family has one signature and a scalar reference (csrc/<family>/<family>_ref.c).
 * SIMD variants reproduce the reference BIT FOR BIT: the arithmetic below is
 * the contract, and the scalar code spells it out. This is what makes results
 * independent of the CPU, the thread count and the batch shape.
 *
 * Canonical dot product ("16 lanes, one accumulator per lane"):
 *   acc[0..15] = +0; for element i (in order): acc[i % 16] = fma(w_i, x_i, acc[i % 16])
 *   then a fixed tree: s8[i] = acc[i] + acc[i+8]; s4[i] = s8[i] + s8[i+4];
 *   s2[i] = s4[i] + s4[i+2]; result = s2[0] + s2[1].
 * Elements past the end never touch their lane (a lane can hold -0, which a
 * +0 product would turn into +0; SIMD tails use masked or -0 contributions).
 *   fp32: w_i = W[r][i];  fp16: w_i = half_to_float(W[r][i]);
 *   int4: w_i = (float)(code_i - 8) * scale_block  (one rounding);
 *   fp4:  w_i = (float)e2m1x2(code_i) * (e4m3(scale_byte) * 0.5f)  (exact);
 *   int8: w_i = (float)code_i, and the finished dot is multiplied by the row scale.
 *
 * Quantized activations (act_precision "int8"): each activation row is cut
 * into 32-element blocks and zero padded to a multiple of CISM_ACT_PAD;
 *   q8: scale = absmax/127, q = clamp(rintf(x * (127/absmax)), +-127)
 * (an all-zero block gets q = 0 and scale 0, and so does a block so small
 * that 127/absmax overflows: its values are below 4e-37). Every integer
 * storage multiplies q8 activations by ONE rule: the exact integer sum s_b
 * of each weight block's products, then one float chain per dot over the
 * blocks in order,
 *   acc = +0; for block b: acc = fma((float)s_b, c_b, acc)
 *   int8: blocks of 32, s_b = sum w_e a_e, c_b = ascale_b, and the finished
 *         dot is multiplied by the row scale;
 *   int4: blocks of 32, s_b = sum (code_e - 8) a_e, c_b = wscale_b * ascale_b
 *         (one rounding);
 *   fp4:  blocks of 16, s_b = sum e2m1x2(code_e) a_e,
 *         c_b = (e4m3(scale_byte_b) * 0.5f) * ascale_(b/2) (one rounding).
 * s_b is exact in int32 (|s_b| <= 32 * 127 * 127), so any summation order
 * gives it: VNNI lanes, maddubs pairs with a bias taken off afterwards, the
 * AMX tile unit, a scalar loop. Weight elements past the row meet zero
 * activations and vanish.
 * fp32/fp16 weights ignore the switch.
 *
 * ggml K-quants (q4_k, q6_k; formats.h). With fp32 activations they are
 * like any storage: the canonical 16-lane dot above over the decoded
 * weights (w_i = csrc/ggml.h's decode, gguf-py's bits; so a q4_k matrix
 * gives the bits of an fp32 matrix holding its decode). With q8
 * activations each 256-element super-block is 8 activation blocks, and a
 * dot keeps 8 float lanes, lane j taking sub-block (or run) j of every
 * super-block in order, then the tree cism_reduce8 (l0+l4, l1+l5, l2+l6,
 * l3+l7; then +2; then +1). For super-block s, block b = 8s + j:
 *   q4_k: isum = sum q_e a_e (q 0..15), asum = sum a_e, both exact;
 *         acc_j = fma((float)(sc_j * isum), d * ascale_b, acc_j);
 *         acc_j = fma((float)(m_j * asum), -(dmin * ascale_b), acc_j)
 *   q6_k: isum = sc_2j * sum_{e<16} (code_e - 32) a_e
 *              + sc_2j+1 * sum_{e>=16} (code_e - 32) a_e  (exact);
 *         acc_j = fma((float)isum, d * ascale_b, acc_j)
 * Every integer there is exact in float32 (|sc isum| <= 63 * 32 * 15 * 127,
 * |m asum| <= 63 * 32 * 127, q6_k's |isum| <= 2 * 128 * 16 * 32 * 127 <
 * 2^24), so only the products d * ascale and the fmas round. Lanes in
 * place of one chain: a row's 8 sub-blocks (their scales and mins too)
 * unpack straight into the 8 lanes of a ymm, with no transposes (and
 * with tokens in lanes each of the 8 is one vector of 16 tokens).
 *
 * Vector activations (max errors against the double-precision function are
 * stated in act_ref.c and checked by tests/test_activations.py).
 */
#ifndef CISM_KERNELS_H
#define CISM_KERNELS_H

#include "formats.h"

#define CISM_ACT_PAD 64
static inline size_t cism_act_len(size_t n) { return cism_div_up(n, CISM_ACT_PAD) * CISM_ACT_PAD; }
/* bf16 activation rows (the opt-in bf16 precision): padded to whole 32-element
 * tile rows, and the row count to a multiple of 32. */
static inline size_t cism_bf16_len(size_t n) { return cism_div_up(n, 32) * 32; }
static inline size_t cism_bf16_rows(size_t T) { return cism_div_up(T, 32) * 32; }

/* T activation rows, in whichever forms the kernel needs. */
typedef struct cism_act {
    const float *x;       /* fp32 rows, row t at x + t*ldx (cols valid floats) */
    size_t ldx;
    const int8_t *q8;     /* q8 rows, zero padded to cism_act_len(cols), row stride ldq */
    const float *qscale;  /* per-block scales, row stride ldqs */
    size_t ldq, ldqs;
    /* bf16 activations in A-tile blocks (pack_bf16): tokens 16g..16g+15,
     * elements 32kb..32kb+31 are the 1 KiB block at xb + g * ldb + 512 kb
     * (16 rows of 32); cism_bf16_rows(T) tokens, zero past T */
    const uint16_t *xb;
    size_t ldb;
    int *err;             /* bf16 kernels set *err = 1 when they cannot get scratch */
} cism_act;

/* Y[t*ldy + r] = dot(row r of W, activation row t), r in [r0, r1), t < T. */
typedef void (*cism_gemm_fn)(const cism_mat *W, size_t r0, size_t r1, const cism_act *A,
                             size_t T, float *Y, size_t ldy);
typedef float (*cism_dot_fn)(const float *a, const float *b, size_t n);
/* y[i] = fma(a, x[i], y[i]) */
typedef void (*cism_axpy_fn)(float a, const float *x, float *y, size_t n);
/* Attention's weighted sum of values, nq queries at once: for each query q
 * and each key k < nk in order, axpy(P[q*ldp + k], V + k*ldv, O + q*ldo, n).
 * Bit-identical to those axpy calls (every element is the same fma chain);
 * a tile only keeps O in registers and loads each value row once for
 * several queries. */
typedef void (*cism_axpy_tile_fn)(const float *P, size_t ldp, size_t nq, const float *V, size_t ldv,
                                  size_t nk, float *O, size_t ldo, size_t n);
/* Attention scores against keys kept transposed in blocks of 16 positions
 * (a key tile): key j < nk <= 16 has element e at Kt[16 * e + j]. For each
 * query i < nq, S[i * lds + j] = the canonical dot of query i (hd floats at
 * Q + i * ldq) with key j: the bits gemm[CISM_FP32] gives with the keys as
 * matrix rows. With keys in lanes the 16 lane chains of the canonical dot
 * are 16 accumulator vectors and its reduction tree is vertical adds.
 * SIMD variants read all 16 lanes of each Kt row (compute on lanes past nk
 * and never store them). */
typedef void (*cism_scores16_fn)(const float *Q, size_t ldq, size_t nq, const float *Kt, size_t hd,
                                 float *S, size_t lds, size_t nk);
/* The same over binary16 caches (kv_precision "fp16": keys and values are
 * rounded to binary16 when stored): each element is widened exactly, so the
 * results are scores16's and axpy_tile's over the widened values. */
typedef void (*cism_scores16_h_fn)(const float *Q, size_t ldq, size_t nq, const uint16_t *Kt, size_t hd,
                                   float *S, size_t lds, size_t nk);
typedef void (*cism_axpy_tile_h_fn)(const float *P, size_t ldp, size_t nq, const uint16_t *V, size_t ldv,
                                    size_t nk, float *O, size_t ldo, size_t n);
/* out[i * stride] = binary16 of x[i], i < n: cism_f32_to_fp16 (nearest even). */
typedef void (*cism_to_f16_fn)(const float *x, size_t n, uint16_t *out, size_t stride);
/* Quantize n floats: writes cism_act_len(n) codes and cism_act_len(n)/32
 * scales, zero beyond n (so kernels may read whole vectors). */
typedef void (*cism_quant8_fn)(const float *x, size_t n, int8_t *q, float *scales);
/* n floats as cism_bf16_len(n) bfloat16 (nearest even, zero beyond n);
 * elements 32kb..32kb+31 go to out + kb * stride. */
typedef void (*cism_pack_bf16_fn)(const float *x, size_t n, uint16_t *out, size_t stride);
/* y = f(x), elementwise; y may alias x. */
typedef void (*cism_unary_fn)(const float *x, float *y, size_t n);
/* y = f(a) * b, elementwise; y may alias a or b. */
typedef void (*cism_binary_fn)(const float *a, const float *b, float *y, size_t n);
/* One row of attention scores (n >= 0) to its softmax weights, in place:
 * s_t = x_t * scale, m = max_t s_t, e_t = exp(s_t - m), x_t = e_t / sum.
 * The maximum and the sum go by 16 lanes, lane i taking elements i, i + 16,
 * ... in order (the maximum from -inf, keeping s if s > m, so NaNs are
 * passed over; the sum from +0), then the lanes' canonical tree
 * (cism_reduce16; for the maximum the same pairs under the same rule).
 * Every level gives the same bits (act_ref.c is the reference). */
typedef void (*cism_softmax_fn)(float *x, size_t n, float scale);
/* The first index of the largest of n floats (std::max_element's rule:
 * index i replaces the best so far only if best < x_i, so ties keep the
 * first, -0 and +0 tie, a NaN never wins, and a NaN at index 0 keeps 0);
 * 0 when n is 0. Every level gives the same index. */
typedef size_t (*cism_argmax_fn)(const float *x, size_t n);

/* amx: avx512vnni plus the tile unit (AMX-INT8 for the exact integer x q8
 * gemms, AMX-BF16 for the opt-in bf16 precision), where Linux grants it */
typedef enum {
    CISM_ISA_REF = 0, CISM_ISA_AVX2 = 1, CISM_ISA_AVX512 = 2, CISM_ISA_AVX512VNNI = 3, CISM_ISA_AMX = 4
} cism_isa;

typedef struct cism_kernels {
    cism_gemm_fn gemm[CISM_NUM_STORAGES];   /* fp32 activations, by storage */
    cism_gemm_fn gemm_int8_q8;               /* int8 weights x q8 activations */
    cism_gemm_fn gemm_int4_q8;               /* int4 weights x q8 activations */
    cism_gemm_fn gemm_fp4_q8;                /* fp4 weights x q8 activations */
    cism_gemm_fn gemm_q4k_q8;                /* q4_k weights x q8 activations */
    cism_gemm_fn gemm_q6k_q8;                /* q6_k weights x q8 activations */
    /* The opt-in bf16 precision (any storage x bf16 activations, fp32 sums
     * in the hardware's order; see gemm/gemm_amx.c and gemm/gemm_avx512bf16.c).
     * NULL where neither AMX-BF16 (amx level) nor AVX512-BF16 (avx512vnni
     * level and up) runs, or CISM_ISA caps below them: callers keep the
     * canonical kernels. */
    cism_gemm_fn gemm_bf16;
    cism_pack_bf16_fn pack_bf16;
    cism_dot_fn dot;
    cism_axpy_fn axpy;
    cism_axpy_tile_fn axpy_tile;
    cism_scores16_fn scores16;
    cism_scores16_h_fn scores16_h;
    cism_axpy_tile_h_fn axpy_tile_h;
    /* The bf16 prefill precision's prompt attention (attn/attn_avx512bf16.c):
     * scores16 and axpy_tile's signatures, not their arithmetic. Inputs
     * rounded to bf16 (nearest even); a score is, from +0, one VDPBF16PS
     * step per element pair (2p, 2p+1) in order (an odd head size pads a
     * zero); each output element, continued from O, one step per key pair
     * (2m, 2m+1) in order, an odd nk's last key paired with a zero weight
     * and value (callers start each call at an even position). NULL where
     * the CPU has no AVX512-BF16 (prompt attention stays canonical). */
    cism_scores16_fn scores16_bf16;
    cism_scores16_h_fn scores16_bf16_h;
    cism_axpy_tile_fn axpy_tile_bf16;
    cism_axpy_tile_h_fn axpy_tile_bf16_h;
    cism_to_f16_fn to_f16;
    cism_quant8_fn quant8;
    cism_unary_fn exp, sigmoid, silu, gelu;
    cism_binary_fn silu_mul, sigmoid_mul;
    cism_softmax_fn softmax;
    cism_argmax_fn argmax;
    /* which variant fills each family, for show_runtime(): "ref", "avx2", ... */
    const char *name_gemm, *name_gemm_q, *name_dot, *name_quant, *name_act, *name_gemm_bf16, *name_attn_bf16;
} cism_kernels;

/* CPU features found (CPUID and XGETBV both agree). */
typedef struct cism_cpu {
    int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq, avx512vnni, avx_vnni, amx_tile;
    int avx512bf16, amx_bf16, amx_int8;
    int os_avx, os_avx512, os_amx;
    int amx_granted; /* Linux let this process use the tile state (ARCH_REQ_XCOMP_PERM) */
    int avx512vbmi;  /* vpermb: the amx level's fp4 lookups (every AMX CPU has it) */
    int gfni;        /* vgf2p8affineqb: the amx level's int4 nibbles (likewise) */
} cism_cpu;

/* Fill the table once (idempotent): every slot gets the reference kernel,
 * then better variants the CPU and the OS support overwrite it, capped by the
 * CISM_ISA environment variable (ref, avx2, avx512, avx512vnni, amx).
 * Returns 0, or -1 when CISM_ISA holds an unknown name (the reference table
 * is then used and cism_isa_error() says why). */
int cism_init(void);
const cism_kernels *cism_table(void);
const cism_cpu *cism_cpu_features(void);
int cism_isa_level(void);       /* highest level in use */
int cism_isa_max(void);         /* highest level this CPU and OS support */
const char *cism_isa_name(int level);
const char *cism_isa_error(void);
/* Force a level (tests): fills the table again; returns 0 or -1 when the
 * CPU cannot run it. Not thread-safe: call while no kernel runs. */
int cism_set_isa(int level);
/* Tests only: an emulated tile unit for the amx level where the CPU has none.
 * `fill` (tests/native/amx_harness.c: gemm/gemm_amx.c and gemm_q8/gemm_q8_amx.c
 * built over scalar stand-ins
 * for the tile instructions) fills the amx slots, given this library's
 * scratch functions so that cism_scratch_fail reaches its kernels. While it
 * is installed cism_set_isa(CISM_ISA_AMX) fills the table with it; NULL
 * removes it (a table at that level drops to the highest real one).
 * cism_isa_max() and cism_cpu_features() keep telling what the CPU has.
 * Returns -1 where the kernels' vector parts cannot run (below avx512vnni or
 * without AVX512-BF16). Not thread-safe, as cism_set_isa. */
typedef void (*cism_amx_emulator)(cism_kernels *k, void *(*scratch_get)(size_t), void (*scratch_put)(void *));
int cism_emulate_amx(cism_amx_emulator fill);

/* Table fillers, one per family and ISA, each in its own translation unit
 * (csrc/<family>/<family>_<isa>.c) compiled with only that ISA's flags:
 *   gemm     fp32 activations, every storage (gemm[]); the opt-in bf16
 *            precision (gemm_bf16, pack_bf16) at amx (the tile unit) and
 *            at avx512bf16 (VDPBF16PS, installed from the avx512vnni level
 *            where the CPU has AVX512-BF16; the amx level replaces it)
 *   gemm_q8  integer weights x q8 activations (gemm_*_q8)
 *   attn     dot, axpy, axpy_tile(_h), scores16(_h); at avx512bf16 (with
 *            the bf16 gemm) the bf16 prefill's scores16_bf16(_h) and
 *            axpy_tile_bf16(_h)
 *   convert  to_f16, quant8
 *   act      the vector activations, softmax, argmax */
void cism_fill_gemm_ref(cism_kernels *k);
void cism_fill_gemm_avx2(cism_kernels *k);
void cism_fill_gemm_avx512(cism_kernels *k);
void cism_fill_gemm_amx(cism_kernels *k);
void cism_fill_gemm_avx512bf16(cism_kernels *k);
void cism_fill_gemm_q8_ref(cism_kernels *k);
void cism_fill_gemm_q8_avx2(cism_kernels *k);
void cism_fill_gemm_q8_avx512(cism_kernels *k);
void cism_fill_gemm_q8_avx512vnni(cism_kernels *k);
void cism_fill_gemm_q8_amx(cism_kernels *k);
void cism_fill_attn_ref(cism_kernels *k);
void cism_fill_attn_avx2(cism_kernels *k);
void cism_fill_attn_avx512(cism_kernels *k);
void cism_fill_attn_avx512bf16(cism_kernels *k);
void cism_fill_convert_ref(cism_kernels *k);
void cism_fill_convert_avx2(cism_kernels *k);
void cism_fill_convert_avx512(cism_kernels *k);
void cism_fill_act_ref(cism_kernels *k);
void cism_fill_act_avx2(cism_kernels *k);
void cism_fill_act_avx512(cism_kernels *k);

/* The canonical reduction tree of 16 lane sums (see the top of this file). */
/* qmax/absmax for a block; a block whose norm would overflow counts as zero
 * (absmax set to 0) so its codes and scale are 0 on every ISA. */
static inline float quant_norm(float *absmax, float qmax) {
    if (!(*absmax > 0.0f)) return 0.0f;
    const float norm = qmax / *absmax;
    if (norm > 3.4028234663852886e38f) {
        *absmax = 0.0f;
        return 0.0f;
    }
    return norm;
}

/* argmax's rule from index `from` on, given the best index so far (the
 * reference is cism_argmax_scan(x, 1, n, 0)). */
static inline size_t cism_argmax_scan(const float *x, size_t from, size_t n, size_t best) {
    for (size_t i = from; i < n; i++)
        if (x[best] < x[i]) best = i;
    return best;
}

/* The lanes of a vector argmax: lane l holds the first largest of its
 * elements (value v[l], index ix[l]) or no index (-1); the result is the
 * largest value's smallest index, 0 if no lane holds one. */
static inline size_t cism_argmax_lanes(const float *v, const int32_t *ix, int lanes) {
    size_t best = 0;
    float top = 0.0f;
    int found = 0;
    for (int l = 0; l < lanes; l++) {
        if (ix[l] < 0) continue;
        if (!found || top < v[l] || (!(v[l] < top) && (size_t)ix[l] < best)) {
            top = v[l];
            best = (size_t)ix[l];
            found = 1;
        }
    }
    return best;
}

/* The K-quant x q8 tree over a dot's 8 lanes (see the top of this file). */
static inline float cism_reduce8(const float *acc) {
    float s4[4];
    for (int i = 0; i < 4; i++) s4[i] = acc[i] + acc[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float cism_reduce16(const float *acc) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

#endif
