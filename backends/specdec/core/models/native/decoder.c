/* Llama decoder layers for a few rows of new tokens, in one native call.
 *
 * Why: a decode step of a small model on CPU is bound by per-call cost, not arithmetic. An eager
 * PyTorch forward of the demo kit's 4-layer target makes ~125 operator calls per token (~1.5 ms of
 * a 2.5 ms step); llama.cpp runs the same weights in 0.4 ms. This file is the step's layers as one
 * call: matrix products that read each weight once for all rows, fused norm / rotary / attention /
 * SiLU, and no allocation of tensors. It covers what decode and verification need (B sequences x
 * T new tokens against their KV-cache slots, causal or under a tree mask); `native/__init__.py` decides when
 * it runs and falls back to the eager layers otherwise. Semantics are those of `llama.py`'s
 * `run_decoder` and `BatchContext` (see there); results equal the eager ones up to float rounding.
 *
 * Every (row, output) dot product is summed in the same order whatever the number of rows, so a
 * token's hidden state does not depend on what else is in the batch: verifying a draft gives the
 * plain step's numbers bit for bit.
 *
 * Weights are passed transposed and blocked: the columns (outputs) ob .. ob + bw of the transposed
 * [in, out] matrix are one contiguous [in, bw] block starting at ob * in, bw = 64 while 64 columns
 * remain, then 16 (`native/__init__.py`'s `blocked`). 16 outputs are one vector, so no horizontal sums are
 * needed, and a block streams from memory in order; output dimensions must be multiples of 16.
 * A model's weights are float32, or float16 where every value is one (`Decoder.wtype`, the
 * `_f16` matmul): widened on load, the products and sums are the float32 ones bit for bit, and a
 * one-row step, which streams every weight from memory, reads half the bytes. A drafter's may be
 * bfloat16 or int8 instead (`WT_BF16`, `WT_I8`, below: rounded, so its drafts may differ;
 * verification does not).
 *
 * Threads (`specdec_set_threads`, the engine's runtime.threads): each matmul's column blocks and
 * each attention (row, head) pair are split over a small pool, the caller included. A column or a
 * (row, head) is computed by one thread in the same order whatever the split, so results are
 * the one-thread ones bit for bit.
 */
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef _Float16 h16 __attribute__((vector_size(32), aligned(2)));

enum { WT_F32 = 0, WT_F16 = 1, WT_BF16 = 2, WT_I8 = 3 }; /* a blocked weight's type (`native.weight_type`) */

typedef struct {
    const float *in_norm;   /* [H], or NULL: no input norm (EAGLE's first layer) */
    const void *qkv;        /* [H, (nq + 2 nkv) hd], transposed and blocked (above) */
    const float *qkv_bias;  /* [(nq + 2 nkv) hd] or NULL */
    const void *o;          /* [nq hd, H], the same */
    const float *o_bias;    /* [H] or NULL */
    const float *post_norm; /* [H] */
    const void *gate_up;    /* [H, 2 I], the same: gate columns, then up */
    const void *down;       /* [I, H], the same */
} Layer;

typedef struct {
    int32_t n_layers, hidden, n_heads, n_kv, head_dim, inter;
    int32_t wtype; /* the weight matrices' type: WT_F32, WT_F16, WT_BF16 or WT_I8 */
    float eps;
    const Layer *layers;
    const float *final_norm; /* [H], or NULL: the caller's output is the last layer's */
} Decoder;

static inline float hsum16(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline v16 ld(const float *p) { return *(const v16 *)p; }
static inline v16 ld_f32(const float *p) { return ld(p); }
static inline v16 ld_f16(const _Float16 *p) {  /* one vcvtph2ps where the CPU has it */
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && defined(__AVX__)
    v8 lo = (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    v8 hi = (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return __builtin_convertvector(*(const h16 *)p, v16);
#endif
}
static inline void st(float *p, v16 v) { *(v16 *)p = v; }
/* x in every lane, as one broadcast load. Written `(v16){0} + x` before (as `bcast8` below once
 * was), it compiled to a scalar add and a register broadcast per row and step of h; as a
 * broadcast load, on an AVX-512 EPYC (Zen 4) a warm 6-row 256 x 768 matmul ran 85 GFLOP/s
 * against 72 and 2 rows 59 against 42; forwards 1.01-1.05x (1 x 5: 1.04x), the prompt lookup
 * engine at batch 1 (k = 4) 1.03x [1.026, 1.043], plain batches of 1 and 8 1.00x and 0.99x
 * (`forward_ab --rev 5608a9a`). Only the sign of an exact zero can differ. */
static inline v16 bcast16(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* Keeps a loaded weight vector in a register: for 3 or 4 rows GCC otherwise folds the load into
 * every row's FMA, which ran those matmuls at half the speed of 5 or 6 rows. Only where a v16 is one
 * register (AVX-512): elsewhere "+v" is an impossible constraint and the file would not compile. */
#if defined(__x86_64__) && defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

/* Each pass over h asks for the weights PREFETCH_H steps of h ahead (every cache line of its
 * columns' row; a hint, computed as an integer: past the end it fetches a neighbour or nothing,
 * never faults). A step's weights (7.3 MB for the demo kit's target) are streamed once per
 * forward, after the Python, the attention and a drafter between two forwards have evicted them;
 * the CPU's own prefetching left the 16-column passes waiting: with the hint a 5-token
 * verification of the kit's target ran 1.17-1.20x faster on an AVX2 EPYC, one token 1.15-1.25x
 * (`forward_ab --shapes`, two models alternating); 32 and 128 steps ahead ran 0.95-0.99x 64's.
 * The AVX-512 kernels (a 64-column block a pass) hint only where a pass has 2 or more rows: on an
 * AVX-512 EPYC (Zen 4) a batch of 8 one-token rows ran 1.05x faster with it (whole baseline
 * engines, `forward_ab --method baseline --batch 8`, two runs of 40 rounds), while batch 1's
 * one-row passes ran 0.97x with it and 1.00x without (`reports/engine-log.md`, "Weight prefetch in
 * the AVX-512 kernels"). Nor does the 8-float one-row pass of Zen 4 (`ONE_ROW_KERNEL`) hint: 55-62
 * GFLOP/s with the hint 16-128 steps ahead against 79-83 without, the kit's 4-layer target's
 * weight shapes streamed from L3 (a C harness over this file). */
#define PREFETCH_H 64
#if defined(__AVX512F__) /* passes of one row hint only without AVX-512 (above) */
#define PREFETCH_ONE_ROW 0
#else
#define PREFETCH_ONE_ROW 1
#endif
/* out[r, ob .. ob + 16 NC) = bias + x[r] @ (the block at ob), for RB rows at once: each weight
 * vector is loaded once per RB rows, and each row's sums run over h in the same order for any RB.
 * WT: the weights' type (float or _Float16), widened to float by LOAD. */
#define MM_KERNEL(RB, NC, WT, LOAD)                                                              \
    static void mm_##RB##_##NC##_##LOAD(const float *x, int64_t N, const WT *wt, int64_t M,      \
                                        int64_t ob, const float *bias, float *out) {            \
        v16 acc[RB][NC];                                                                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                     \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++)                                     \
            acc[r][c] = bias ? ld(bias + ob + 16 * c) : (v16){0};                                \
        _Pragma("GCC unroll 1") for (int64_t h = 0; h < N; h++) {                                \
            const WT *w = wt + ob * N + h * 16 * NC;                                             \
            _Pragma("GCC unroll 4") for (int b = 0; (RB > 1 || PREFETCH_ONE_ROW) && b < 16 * NC * (int)sizeof(WT); b += 64) \
                __builtin_prefetch((const void *)((uintptr_t)w + PREFETCH_H * 16 * NC * sizeof(WT) + b), 0, 0); \
            v16 wv[NC];                                                                          \
            _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) {                               \
                wv[c] = LOAD(w + 16 * c);                                                        \
                IN_REGISTER(wv[c]);                                                              \
            }                                                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                               \
                v16 xv = bcast16(x[r * N + h]);                                                  \
                _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) acc[r][c] += xv * wv[c];    \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                     \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) st(out + r * M + ob + 16 * c, acc[r][c]); \
    }
/* One row of a 64-column block on AMD Zen 4 (which GCC 12.2 calls znver3, with AVX-512, and newer
 * GCC znver4) passes through the 8-float kernel (`mm8_1x4`, below: 8 ymm accumulators). Zen 4 runs
 * 512-bit operations on 256-bit halves, and its 16-float conversions (vcvtph2ps zmm) bound a
 * one-row pass: a loop of 4 of them and 4 FMAs, 64 columns a step of h, took ~7.3 cycles a step,
 * one of 8 8-float conversions and 8 FMAs ~4.3. One-row float16 passes ran 50-54 GFLOP/s, warm or
 * from L3, and 85-93 warm, 80-83 from L3 through 8 floats (float32 weights 1.00x warm, 1.12x from
 * L3; a C harness over this file, the kit's target's shapes). Not on other AVX-512 CPUs: where a
 * 16-float conversion issues every cycle (Intel's), 8 8-float ones would take twice the 4
 * 16-float ones; not measured there. More rows are bound by their FMAs, not the conversions: 2
 * rows converting 8 floats at a time ran 1.02x (the loop alone). The sums are the same bit for
 * bit either way: each output adds one FMA a step of h, in order, in one accumulator. */
#if defined(__znver3__) || defined(__znver4__)
#define ONE_ROW_KERNEL(WT, LOAD, LOAD8)                                                          \
    MM8_KERNEL(1, 4, WT, LOAD8)                                                                  \
    static void mm_1_4_##LOAD(const float *x, int64_t N, const WT *wt, int64_t M, int64_t ob,    \
                              const float *bias, float *out) {                                   \
        mm8_1x4_##LOAD8(x, N, wt + ob * N, 64, bias ? bias + ob : NULL, out + ob, M);            \
    }
#else
#define ONE_ROW_KERNEL(WT, LOAD, LOAD8) MM_KERNEL(1, 4, WT, LOAD)
#endif
/* up to 6 rows x 64 outputs: 24 accumulators and 4 weight vectors fit AVX-512's 32 registers */
#define MM_KERNELS(WT, LOAD, LOAD8)                                                              \
    ONE_ROW_KERNEL(WT, LOAD, LOAD8)                                                              \
    MM_KERNEL(2, 4, WT, LOAD) MM_KERNEL(3, 4, WT, LOAD)                                          \
    MM_KERNEL(4, 4, WT, LOAD) MM_KERNEL(5, 4, WT, LOAD) MM_KERNEL(6, 4, WT, LOAD)                \
    MM_KERNEL(1, 1, WT, LOAD) MM_KERNEL(2, 1, WT, LOAD) MM_KERNEL(3, 1, WT, LOAD)                \
    MM_KERNEL(4, 1, WT, LOAD) MM_KERNEL(5, 1, WT, LOAD) MM_KERNEL(6, 1, WT, LOAD)                \
    /* out [R, begin .. end) of x [R, N] @ wt [N, M] (blocked, above) + bias; begin and end    \
     * lie on block boundaries */                                                                \
    static void matmul_##LOAD(const float *x, int64_t R, int64_t N, const WT *wt,               \
                              const float *bias, int64_t M, float *out, int64_t begin, int64_t end) { \
        typedef void (*fn)(const float *, int64_t, const WT *, int64_t, int64_t, const float *, float *); \
        static const fn by4[ROWS + 1] = {0, mm_1_4_##LOAD, mm_2_4_##LOAD, mm_3_4_##LOAD,        \
                                         mm_4_4_##LOAD, mm_5_4_##LOAD, mm_6_4_##LOAD};          \
        static const fn by1[ROWS + 1] = {0, mm_1_1_##LOAD, mm_2_1_##LOAD, mm_3_1_##LOAD,        \
                                         mm_4_1_##LOAD, mm_5_1_##LOAD, mm_6_1_##LOAD};          \
        FOR_EACH_PASS(R, M, begin, end, by4, by1, x + r * N, N, wt, M, ob, bias, out + r * M)    \
    }
#define ROWS 6
/* Rows of the next pass over a block with `left` rows to go: as few passes as ROWS allows, of
 * sizes as even as they go (8 rows: 4 + 4, not 6 + 2, whose 2-row pass loaded a weight vector
 * for every 2 FMAs). A row's sums do not depend on the rows in its pass. */
static inline int64_t row_block(int64_t left) {
    int64_t passes = (left + ROWS - 1) / ROWS;
    return (left + passes - 1) / passes;
}
/* The walk of the 16-float, bfloat16 and int8 matmuls over out [R, begin .. end): each 64-column
 * block's rows in passes of row_block's sizes through by4[rb] (a kernel of 4 16-column units),
 * then each remaining 16-column block's through by1[rb]; the kernel's arguments (the rest) name
 * the pass's first row r and first column ob. */
#define FOR_EACH_PASS(R, M, begin, end, by4, by1, ...)                                           \
    for (int64_t ob = (begin), whole_ = (M) / 64 * 64; ob < (end); ob += ob < whole_ ? 64 : 16) \
        for (int64_t r = 0, rb; r < (R); r += rb)                                                \
            (ob < whole_ ? by4 : by1)[rb = row_block((R) - r)](__VA_ARGS__);
/* 8-float kernels (one ymm register a vector). Without AVX-512 they are the matmul: a v16 is two
 * ymm registers there, and GCC lowered the 16-float kernels above badly: it kept the accumulators
 * in memory and broadcast each x through 16 scalar stores (on an AVX2 EPYC one row of a
 * 1536 x 256 matmul took 191 us, F.linear's 8x, and 6 rows 6x that). With AVX-512 on Zen 4 they
 * take a one-row pass (`ONE_ROW_KERNEL`, above). They work on 8-float halves, one 16-column unit
 * c of a block at a time (its weights at stride 16 NC floats a step of h): RB rows x 2 halves are
 * 2 RB ymm accumulators, beside 2 weight halves and a broadcast, so 6 rows fit 16 registers.
 * Every output's sum runs over h in the same order, with the same FMAs, for any RB: results do
 * not depend on the rows beside a row. */
static inline v8 ld8_f32(const float *p) { return *(const v8 *)p; }
static inline v8 ld8_f16(const _Float16 *p) {
#if defined(__F16C__)
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    typedef _Float16 h8 __attribute__((vector_size(16), aligned(2)));
    return __builtin_convertvector(*(const h8 *)p, v8);
#endif
}
/* x in every lane, as one broadcast load. Written `(v8){0} + x` (as the 16-float kernels were
 * until `bcast16`) it compiled to an add and a register broadcast per row and step of h, on the FP
 * pipes the FMAs need: 5-40 rows of a matmul ran 1.6-1.7x slower (the same numbers, but for the
 * sign of an exact zero). */
static inline v8 bcast8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
/* Keeps a loaded weight vector in a register where 3 or more rows use it: GCC folded float32
 * loads into every row's FMA (float16 ones pass through a conversion, and stayed in registers),
 * and float32 weights ran 3 and 4 rows at 49-53 GFLOP/s against 5-6 rows' 82-99; kept, 62-74 and
 * 76-91 (a C harness over this file, the kit's matmul shapes); a float32 checkpoint's 5-token
 * verification 1.07-1.08x, a batch of 8 one-token rows 1.06x (`forward_ab --kit` of the kit's
 * target saved in float32, 400 pairs a shape). Not for fewer rows: one row uses each vector once
 * (kept, its 8 left no register free, 38 -> 28 GFLOP/s), and the 2-row kernel's forward ran 0.91x. */
#if defined(__x86_64__)
#define IN_YMM(v) __asm__("" : "+x"(v))
#else
#define IN_YMM(v) (void)0
#endif
/* 3 rows x 2 units (`mm8_3x2`): 12 accumulators. With one unit (6 accumulators) 3 rows waited on
 * the FMAs' latency: 73 GFLOP/s against 4-6 rows' 93-98 (float16, the kit's shapes, warm). The 3
 * broadcasts, 4 weight halves and 12 accumulators do not fit 16 registers, so each unit loads its
 * 2 halves in turn and broadcasts each row's input again for it (`BCAST8_AGAIN`: written in C, GCC
 * kept the first broadcasts and spilled 2 accumulators, 44 GFLOP/s): 92-97 GFLOP/s (float32
 * weights 68-82, from 64-75). Each output still sums over h in order in one accumulator. */
#if defined(__x86_64__) && defined(__AVX__)
#define BCAST8_AGAIN(xv, p) __asm__ volatile("vbroadcastss %1, %0" : "=x"(xv) : "m"(*(p)))
#else
#define BCAST8_AGAIN(xv, p) ((xv) = bcast8(*(p)))
#endif
#define MM8_KERNEL(RB, U, WT, LOAD)                                                              \
    static void mm8_##RB##x##U##_##LOAD(const float *x, int64_t N, const WT *w, int64_t S,      \
                                        const float *bias, float *out, int64_t M) {             \
        v8 acc[RB][2 * U];                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                     \
        _Pragma("GCC unroll 8") for (int q = 0; q < 2 * U; q++)                                  \
            acc[r][q] = bias ? ld8_f32(bias + 8 * q) : (v8){0};                                  \
        _Pragma("GCC unroll 1") for (int64_t h = 0; h < N; h++) {                                \
            v8 wv[2 * U];                                                                        \
            _Pragma("GCC unroll 4") for (int b = 0; (RB > 1 || PREFETCH_ONE_ROW) && b < 16 * U * (int)sizeof(WT); b += 64) \
                __builtin_prefetch((const void *)((uintptr_t)(w + h * S) + PREFETCH_H * S * sizeof(WT) + b), 0, 0); \
            if (RB > 2 && U > 1) { /* a unit at a time, each row's input broadcast again (above) */ \
                _Pragma("GCC unroll 4") for (int c = 0; c < U; c++) {                            \
                    wv[0] = LOAD(w + h * S + 16 * c), wv[1] = LOAD(w + h * S + 16 * c + 8);      \
                    IN_YMM(wv[0]);                                                               \
                    IN_YMM(wv[1]);                                                               \
                    _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                       \
                        v8 xv;                                                                   \
                        BCAST8_AGAIN(xv, x + r * N + h);                                         \
                        acc[r][2 * c] += xv * wv[0];                                             \
                        acc[r][2 * c + 1] += xv * wv[1];                                         \
                    }                                                                            \
                }                                                                                \
                continue;                                                                        \
            }                                                                                    \
            _Pragma("GCC unroll 8") for (int q = 0; q < 2 * U; q++) {                            \
                wv[q] = LOAD(w + h * S + 8 * q);                                                 \
                if (RB > 2) IN_YMM(wv[q]);                                                       \
            }                                                                                    \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                               \
                v8 xv = bcast8(x[r * N + h]);                                                    \
                _Pragma("GCC unroll 8") for (int q = 0; q < 2 * U; q++) acc[r][q] += xv * wv[q]; \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                     \
        _Pragma("GCC unroll 8") for (int q = 0; q < 2 * U; q++) *(v8 *)(out + r * M + 8 * q) = acc[r][q]; \
    }
#if defined(__AVX512F__)
MM_KERNELS(float, ld_f32, ld8_f32)
MM_KERNELS(_Float16, ld_f16, ld8_f16)
#else
/* U 16-column units at once where few rows leave registers free: one row's 2 accumulators are a
 * chain of dependent FMAs (a one-row matmul waited on their latency), 4 units give it 8. Each
 * output's sum still runs over h in order in one accumulator, whatever RB and U. */
#define MM8_KERNELS(WT, LOAD)                                                                    \
    MM8_KERNEL(1, 1, WT, LOAD) MM8_KERNEL(2, 1, WT, LOAD) MM8_KERNEL(3, 1, WT, LOAD)             \
    MM8_KERNEL(4, 1, WT, LOAD) MM8_KERNEL(5, 1, WT, LOAD) MM8_KERNEL(6, 1, WT, LOAD)             \
    MM8_KERNEL(1, 4, WT, LOAD) MM8_KERNEL(2, 2, WT, LOAD) MM8_KERNEL(3, 2, WT, LOAD)             \
    static void matmul_##LOAD(const float *x, int64_t R, int64_t N, const WT *wt,               \
                              const float *bias, int64_t M, float *out, int64_t begin, int64_t end) { \
        typedef void (*fn)(const float *, int64_t, const WT *, int64_t, const float *, float *, int64_t); \
        static const fn by[ROWS + 1] = {0, mm8_1x1_##LOAD, mm8_2x1_##LOAD, mm8_3x1_##LOAD,       \
                                        mm8_4x1_##LOAD, mm8_5x1_##LOAD, mm8_6x1_##LOAD};        \
        int64_t whole = M / 64 * 64;                                                             \
        for (int64_t ob = begin; ob < end; ob += ob < whole ? 64 : 16) {                         \
            int64_t units = ob < whole ? 4 : 1; /* 16-column units of this block */              \
            for (int64_t r = 0, rb; r < R; r += rb) {                                            \
                rb = row_block(R - r);                                                           \
                int64_t u = units < 4 || rb > 3 ? 1 : rb == 3 ? 2 : 4 / rb;                      \
                fn f = u == 4 ? mm8_1x4_##LOAD : u < 2 ? by[rb] : rb == 3 ? mm8_3x2_##LOAD : mm8_2x2_##LOAD; \
                for (int64_t c = 0; c < units; c += u)                                           \
                    f(x + r * N, N, wt + ob * N + 16 * c, 16 * units, bias ? bias + ob + 16 * c : NULL, \
                      out + r * M + ob + 16 * c, M);                                             \
            }                                                                                    \
        }                                                                                        \
    }
MM8_KERNELS(float, ld8_f32)
MM8_KERNELS(_Float16, ld8_f16)
#define matmul_ld_f32 matmul_ld8_f32
#define matmul_ld_f16 matmul_ld8_f16
#endif

/* The loop of the bfloat16 and int8 kernels over a block of 16 NC columns (`MMB_KERNEL`,
 * `MMQ_KERNEL`): each of `steps` steps takes NC 64-byte weight vectors from `w` on, loaded once
 * for all RB rows, and each row's 32-bit word `word` (of r and s: a bfloat16 pair, four bytes)
 * broadcast to every lane, and DOT adds their products into acc[r][c]. */
#define DOT_STEPS(RB, NC, acc, w, steps, word, DOT)                                              \
    _Pragma("GCC unroll 1") for (int64_t s = 0; s < (steps); s++) {                              \
        const char *step_ = (const char *)(w) + s * 64 * NC;                                     \
        __m512i wv[NC];                                                                          \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) {                                   \
            wv[c] = _mm512_loadu_si512((const void *)(step_ + 64 * c));                          \
            IN_REGISTER(wv[c]);                                                                  \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                                   \
            __m512i xv = _mm512_set1_epi32(word);                                                \
            _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) acc[r][c] = DOT(acc[r][c], xv, wv[c]); \
        }                                                                                        \
    }

/* A buffer of the calling thread's, at least `bytes` long and valid until its next call, for a
 * matmul's converted input (`to_bf16_pairs`, `to_int8_rows`: one per matmul, read by the pool's
 * workers during it); NULL where it cannot grow. */
#if defined(__AVX512BF16__) || defined(__AVX512VNNI__)
static void *input_scratch(int64_t bytes) {
    static __thread void *buf;
    static __thread int64_t cap;
    if (bytes > cap) {
        void *grown = realloc(buf, bytes);
        if (!grown) return NULL;
        buf = grown, cap = bytes;
    }
    return buf;
}
#endif

/* bfloat16 weights (WT_BF16): a drafter's, where the CPU has AVX512-BF16 (`specdec_has_bf16`).
 * Why: a drafter's proposal is matmuls of one or a few rows, bound by the FMA pipes (the demo
 * kit's EAGLE head, two layers as wide as the target's four, cost 0.68 ms a proposal beside a
 * 0.23 ms plain step); vdpbf16ps multiplies two pairs of bfloat16s per float32 lane where an FMA
 * multiplies one pair of floats: one row of the kit's shapes ran 84-92 GFLOP/s against float32's
 * 45-48, five rows 215-225 against 108-115 (a C harness over this file, weights in L3; a 256-bit
 * variant and a prefetching one were no faster). The input rows are rounded to bfloat16 too (to
 * nearest even), once per matmul. A draft is only a proposal: the target verifies it in float32
 * as before, so output is unchanged and only acceptance can move. Layout: a block's [in, bw]
 * columns as [in / 2, bw, 2], each 32-bit lane's pair (w[2p, j], w[2p + 1, j]) beside the input
 * pair (x[2p], x[2p + 1]) broadcast to every lane (`native.blocked`). Each output still sums its
 * pairs in order in one accumulator whatever the rows beside it, so a row's draft does not depend
 * on its batch. */
#if defined(__AVX512BF16__)
#define DOT_BF16(acc, x, w) _mm512_dpbf16_ps(acc, (__m512bh)(x), (__m512bh)(w))
#define MMB_KERNEL(RB, NC)                                                                       \
    static void mmb_##RB##_##NC(const uint32_t *x, int64_t N, const uint16_t *wt, int64_t M,    \
                                int64_t ob, const float *bias, float *out) {                    \
        __m512 acc[RB][NC];                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                     \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++)                                     \
            acc[r][c] = bias ? _mm512_loadu_ps(bias + ob + 16 * c) : _mm512_setzero_ps();        \
        DOT_STEPS(RB, NC, acc, wt + ob * N, N / 2, (int)x[r * (N / 2) + s], DOT_BF16)            \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                     \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + r * M + ob + 16 * c, acc[r][c]); \
    }
MMB_KERNEL(1, 4) MMB_KERNEL(2, 4) MMB_KERNEL(3, 4) MMB_KERNEL(4, 4) MMB_KERNEL(5, 4) MMB_KERNEL(6, 4)
MMB_KERNEL(1, 1) MMB_KERNEL(2, 1) MMB_KERNEL(3, 1) MMB_KERNEL(4, 1) MMB_KERNEL(5, 1) MMB_KERNEL(6, 1)
/* out [R, begin .. end) of x [R, N / 2] (bfloat16 pairs, `to_bf16_pairs`) @ wt (bfloat16 blocked) + bias */
static void matmul_bf16(const uint32_t *x, int64_t R, int64_t N, const uint16_t *wt, const float *bias, int64_t M,
                        float *out, int64_t begin, int64_t end) {
    typedef void (*fn)(const uint32_t *, int64_t, const uint16_t *, int64_t, int64_t, const float *, float *);
    static const fn by4[ROWS + 1] = {0, mmb_1_4, mmb_2_4, mmb_3_4, mmb_4_4, mmb_5_4, mmb_6_4};
    static const fn by1[ROWS + 1] = {0, mmb_1_1, mmb_2_1, mmb_3_1, mmb_4_1, mmb_5_1, mmb_6_1};
    FOR_EACH_PASS(R, M, begin, end, by4, by1, x + r * (N / 2), N, wt, M, ob, bias, out + r * M)
}
/* x [R, N] rounded to bfloat16 (to nearest even, as torch's conversion), as [R, N / 2] pairs in a
 * buffer of the calling thread's, valid until its next call; NULL where it cannot grow */
static const uint32_t *to_bf16_pairs(const float *x, int64_t R, int64_t N) {
    uint16_t *buf = input_scratch(sizeof(uint16_t) * R * N);
    if (!buf) return NULL;
    int64_t n = R * N, i = 0;
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(buf + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        buf[i] = (u & 0x7fffffff) > 0x7f800000 ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
    return (const uint32_t *)buf;
}
#endif

/* int8 weights (WT_I8): a drafter's, where the CPU has AVX512-VNNI (`specdec_has_int8`). Why:
 * bfloat16 halved a drafter's matmuls, and one row (a chain's depth) still streams 2 bytes a
 * weight from L3 (84-92 GFLOP/s there on the kit's shapes); vpdpbusd multiplies four pairs of
 * bytes per int32 lane, and one row of the same shapes ran 159-176 GFLOP/s, five rows 294-306
 * against 220-231 (a C harness over this file, weights in L3, the rows' quantization included).
 * Each output column j has a scale ws[j] = max |w[:, j]| / 127 and int8 weights w8 = w / ws
 * rounded; each input row r is quantized once per matmul to xs[r] = max |x[r]| / 127 and bytes
 * x8 + 128 (vpdpbusd takes unsigned bytes), so out = xs[r] ws[j] (sum x8 w8) + bias[j], the
 * sum exact in int32 once comp[j] = 128 sum w8[:, j] is taken off. A row's draft does not depend
 * on its batch (its scale is its own, and integer sums have no order). Layout (`native.blocked`):
 * ws [M] floats, comp [M] int32s, then each block's [in, bw] columns as [in / 4, bw, 4], each
 * lane's four bytes (w8[4q .. 4q + 3, j]) beside the input's four broadcast to every lane. */
#if defined(__AVX512VNNI__)
static inline int32_t quad(const uint8_t *bytes) { /* four input bytes, as one word */
    int32_t word;
    memcpy(&word, bytes, sizeof word);
    return word;
}
#define MMQ_KERNEL(RB, NC)                                                                       \
    static void mmq_##RB##_##NC(const uint8_t *x, const float *xs, int64_t N, const int8_t *wt,   \
                                const float *ws, const int32_t *comp, int64_t M, int64_t ob,    \
                                const float *bias, float *out) {                                \
        __m512i acc[RB][NC];                                                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                     \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_si512(); \
        DOT_STEPS(RB, NC, acc, wt + ob * N, N / 4, quad(x + r * N + 4 * s), _mm512_dpbusd_epi32)  \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                     \
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) {                                   \
            int64_t j = ob + 16 * c;                                                             \
            __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], _mm512_loadu_si512((const void *)(comp + j)))); \
            /* one explicit FMA: a multiply then an add, GCC contracted in some kernels only */   \
            v = _mm512_fmadd_ps(_mm512_mul_ps(v, _mm512_loadu_ps(ws + j)), _mm512_set1_ps(xs[r]),   \
                                bias ? _mm512_loadu_ps(bias + j) : _mm512_setzero_ps());       \
            _mm512_storeu_ps(out + r * M + j, v);                                                \
        }                                                                                        \
    }
MMQ_KERNEL(1, 4) MMQ_KERNEL(2, 4) MMQ_KERNEL(3, 4) MMQ_KERNEL(4, 4) MMQ_KERNEL(5, 4) MMQ_KERNEL(6, 4)
MMQ_KERNEL(1, 1) MMQ_KERNEL(2, 1) MMQ_KERNEL(3, 1) MMQ_KERNEL(4, 1) MMQ_KERNEL(5, 1) MMQ_KERNEL(6, 1)
/* out [R, begin .. end) of x (`to_int8_rows`: R scales, then [R, N] bytes) @ wt (int8 blocked) + bias */
static void matmul_i8(const void *in, int64_t R, int64_t N, const void *wt, const float *bias, int64_t M, float *out,
                      int64_t begin, int64_t end) {
    typedef void (*fn)(const uint8_t *, const float *, int64_t, const int8_t *, const float *, const int32_t *,
                       int64_t, int64_t, const float *, float *);
    static const fn by4[ROWS + 1] = {0, mmq_1_4, mmq_2_4, mmq_3_4, mmq_4_4, mmq_5_4, mmq_6_4};
    static const fn by1[ROWS + 1] = {0, mmq_1_1, mmq_2_1, mmq_3_1, mmq_4_1, mmq_5_1, mmq_6_1};
    const float *xs = in, *ws = wt;
    const uint8_t *x = (const uint8_t *)(xs + R);
    const int32_t *comp = (const int32_t *)(ws + M);
    const int8_t *w8 = (const int8_t *)(comp + M);
    FOR_EACH_PASS(R, M, begin, end, by4, by1, x + r * N, xs + r, N, w8, ws, comp, M, ob, bias, out + r * M)
}
/* x [R, N] (N % 16 == 0) quantized per row: R scales max |x[r]| / 127 (1 for a row of zeros),
 * then [R, N] bytes, x / scale rounded to nearest even, clamped to +-127, plus 128; in a buffer
 * of the calling thread's, valid until its next call; NULL where it cannot grow */
static const void *to_int8_rows(const float *x, int64_t R, int64_t N) {
    float *buf = input_scratch(R * (int64_t)sizeof(float) + R * N);
    if (!buf) return NULL;
    uint8_t *q = (uint8_t *)(buf + R);
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * N;
        __m512 top = _mm512_setzero_ps();
        for (int64_t i = 0; i < N; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
        float m = _mm512_reduce_max_ps(top), s = m > 0 ? m / 127.0f : 1.0f;
        __m512 inv = _mm512_set1_ps(1.0f / s);
        buf[r] = s;
        for (int64_t i = 0; i < N; i += 16) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + i), inv));
            v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(q + r * N + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(128))));
        }
    }
    return buf;
}
#endif

int specdec_has_int8(void) {
#if defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

int specdec_has_bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* A pool of worker threads for parallel sections, started on demand. The caller runs part 0 of
 * each section; a worker spins up to SPIN_NS for the next one, then sleeps on a condition
 * variable (when idle). A forward's sections follow each other within microseconds, and the
 * engine's Python between two forwards takes 0.1-0.5 ms: with a 50 us spin every forward began by
 * waking a sleeping worker, and the baseline engine at 2 threads ran 0.95x the one-thread native
 * call; with 1 ms it ran 1.24x at batch 1 and 1.39x at batch 8 (forward_ab, identical outputs). */
#define MAX_THREADS 64
#define SPIN_NS 1000000
typedef void (*part_fn)(void *arg, int part, int parts);
static struct {
    pthread_mutex_t lock, busy;  /* busy: held by the caller of the section under way */
    pthread_cond_t wake;
    _Atomic uint64_t generation; /* bumped per section */
    _Atomic int pending;         /* workers yet to finish it, or to see it (those not taking part) */
    uint64_t born;               /* the generation before the section that starts a worker */
    part_fn fn;
    void *arg;
    int parts, threads, started;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .busy = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .threads = 1};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static void *pool_worker(void *id_ptr) {
    int id = (int)(intptr_t)id_ptr;
    uint64_t seen = pool.born;  /* it may start after that section is published */
    for (;;) {
        int64_t since = now_ns();
        for (int spin = 1; atomic_load_explicit(&pool.generation, memory_order_acquire) == seen; spin++) {
            relax();
            if (spin % 256 == 0 && now_ns() - since > SPIN_NS) {
                pthread_mutex_lock(&pool.lock);
                while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                pthread_mutex_unlock(&pool.lock);
            }
        }
        seen++;  /* every worker acknowledges every section before the next is published */
        if (id < pool.parts) pool.fn(pool.arg, id, pool.parts);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

/* A forked child has none of its parent's workers: it starts its own. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.busy, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Threads a parallel section uses, the caller included (1: none of the workers runs). */
int specdec_set_threads(int threads) {
    pool.threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    return pool.threads;
}

/* fn(arg, p, parts) for every p < parts, part 0 on the calling thread, parts capped at the pool's
 * threads. A section met while another caller's runs is run by its own caller, part by part. */
static void parallel(part_fn fn, void *arg, int parts) {
    if (parts > pool.threads) parts = pool.threads;
    if (parts <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int p = 0; p < parts; p++) fn(arg, p, parts);
        return;
    }
    static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;
    pthread_once(&fork_handler, register_fork_handler);
    pool.born = atomic_load(&pool.generation);
    while (pool.started < parts - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, pool_worker, (void *)(intptr_t)(pool.started + 1)) != 0) break;
        pthread_detach(t);
        pool.started++;
    }
    if (parts > pool.started + 1) parts = pool.started + 1;
    pool.fn = fn, pool.arg = arg, pool.parts = parts;
    atomic_store_explicit(&pool.pending, pool.started, memory_order_relaxed);
    pthread_mutex_lock(&pool.lock);  /* a worker about to sleep checks the generation under it */
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(arg, 0, parts);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) relax();
    pthread_mutex_unlock(&pool.busy);
}

/* A matmul as a parallel section: part p computes the columns from p M / parts, rounded down to
 * its block's start, to the next part's start. */
typedef struct {
    int wtype; /* the weights' type (WT_F32 ...); for WT_BF16, x is bfloat16 pairs; WT_I8, `to_int8_rows` */
    const void *x;
    int64_t R, N;
    const void *wt;
    const float *bias;
    int64_t M;
    float *out;
} MatmulJob;

static int64_t block_start(int64_t col, int64_t M) {
    int64_t whole = M / 64 * 64;
    return col >= M ? M : col < whole ? col / 64 * 64 : col / 16 * 16;
}

static void matmul_part(void *arg, int p, int parts) {
    const MatmulJob *j = arg;
    int64_t begin = block_start(j->M * p / parts, j->M), end = block_start(j->M * (p + 1) / parts, j->M);
#if defined(__AVX512BF16__)
    if (j->wtype == WT_BF16) matmul_bf16(j->x, j->R, j->N, j->wt, j->bias, j->M, j->out, begin, end);
    else
#endif
#if defined(__AVX512VNNI__)
    if (j->wtype == WT_I8) matmul_i8(j->x, j->R, j->N, j->wt, j->bias, j->M, j->out, begin, end);
    else
#endif
    if (j->wtype == WT_F16) matmul_ld_f16(j->x, j->R, j->N, j->wt, j->bias, j->M, j->out, begin, end);
    else matmul_ld_f32(j->x, j->R, j->N, j->wt, j->bias, j->M, j->out, begin, end);
}

/* out [R, M] = x [R, N] @ wt + bias, weights of type `wtype`; split over the pool's threads
 * where there are at least two 64-column blocks to share (one part below 64 columns: with none,
 * an output of 16-48 columns was never computed). Bfloat16 weights take x rounded to bfloat16
 * pairs first (N even), int8 weights x quantized per row (N % 16 == 0); where that buffer cannot
 * grow, out is left as it was (-2). */
static int matmul_any(int wtype, const float *x, int64_t R, int64_t N, const void *wt, const float *bias,
                      int64_t M, float *out) {
    const void *in = x;
#if defined(__AVX512BF16__)
    if (wtype == WT_BF16 && !(in = to_bf16_pairs(x, R, N))) return -2;
#else
    if (wtype == WT_BF16) return -1;
#endif
#if defined(__AVX512VNNI__)
    if (wtype == WT_I8 && !(in = to_int8_rows(x, R, N))) return -2;
#else
    if (wtype == WT_I8) return -1;
#endif
    MatmulJob j = {wtype, in, R, N, wt, bias, M, out};
    int64_t parts = M / 64 < MAX_THREADS ? M / 64 : MAX_THREADS;
    parallel(matmul_part, &j, (int)(parts > 1 ? parts : 1));
    return 0;
}

/* A decoder's matmul: its weights' type decides the kernel. */
static int matmul(const Decoder *d, const float *x, int64_t R, int64_t N, const void *wt, const float *bias,
                   int64_t M, float *out) {
    return matmul_any(d->wtype, x, R, N, wt, bias, M, out);
}

/* The same matmul for a projection outside the decoder layers (output heads, EAGLE's fc,
 * Medusa's heads): `linear.InferenceLinear` sends up to NATIVE_MAX_ROWS rows here. */
int specdec_matmul(int32_t wtype, const float *x, int64_t R, int64_t N, const void *wt, const float *bias, int64_t M,
                   float *out) {
    if (M % 16 || N % 2 || (wtype == WT_I8 && N % 16) || wtype < WT_F32 || wtype > WT_I8) return -1;
    return matmul_any(wtype, x, R, N, wt, bias, M, out);
}

/* The rest of a forward (norms, SiLU, attention) works on `vf`, VW floats: one register, 16 with
 * AVX-512, else 8. Written on 16-float vectors, GCC lowered that code for AVX2 as it did the
 * matmuls (above): vectors kept on the stack, each broadcast through scalar stores, and on an AVX2
 * EPYC attention took 0.83x the matmuls' time at batch 8 (perf), and what was not a matmul about
 * 1.4 ms of a 2.7 ms 8 x 1 forward. Every row and (row, head) pair is still computed in one order
 * whatever else the forward runs; VW sets that order, so the two kinds of CPU round differently. */
#if defined(__AVX512F__)
#define VW 16
typedef v16 vf;
typedef int32_t vfi __attribute__((vector_size(64)));
#else
#define VW 8
typedef v8 vf;
typedef int32_t vfi __attribute__((vector_size(32)));
#endif
static inline vf ldv(const float *p) { return *(const vf *)p; }
/* x in every lane: a broadcast, where `(vf){0} + x` is an add and a broadcast (above, bcast8) */
static inline vf bcastv(float x) {
#if VW == 16
    return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
    return bcast8(x);
#endif
}
static inline void stv(float *p, vf v) { *(vf *)p = v; }

/* per lane: mask (a comparison's all-ones or zero) ? a : b */
static inline vf sel(vfi mask, vf a, vf b) { return (vf)(((vfi)a & mask) | ((vfi)b & ~mask)); }

/* The sum of a vector's lanes: halves (to 4 lanes), then (0 + 2) + (1 + 3) */
static inline float hsumv(vf v) {
#if VW == 16
    return hsum16(v);
#else
    v4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}

/* exp of VW floats (Cephes' expf polynomial: within 2 ulp of expf over float's range) */
static inline vf expv(vf x) {
    const vf zero = {0};
    x = sel(x < -87.3f, zero - 87.3f, x);
    x = sel(x > 88.3f, zero + 88.3f, x);
    vf fx = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(fx, vfi), vf);
    n = sel(n > fx, n - 1.0f, n);  /* floor */
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf y = zero + 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    vfi bits = (__builtin_convertvector(n, vfi) + 127) << 23;
    return y * (vf)bits;
}

static void rms_norm(const float *x, const float *w, int64_t H, float eps, float *out) {
    vf acc = {0};
    for (int64_t h = 0; h < H; h += VW) acc += ldv(x + h) * ldv(x + h);
    float scale = 1.0f / sqrtf(hsumv(acc) / (float)H + eps);
    for (int64_t h = 0; h < H; h += VW) stv(out + h, ldv(x + h) * scale * ldv(w + h));
}

/* x * cos + roll(x, hd / 2) * signed_sin, in place, for one head: each pair (x[d], x[d + hd / 2])
 * at once. Written over all of x with the roll's index taken modulo hd, the loop stayed scalar, and
 * it took 2.6% of EAGLE's engine time at batch 1 (perf; the attention, which it feeds, 11%) */
static void rope(float *restrict x, const float *restrict cos, const float *restrict sin, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t d = 0; d < half; d++) {
        float lo = x[d], hi = x[d + half];
        x[d] = lo * cos[d] + hi * sin[d];
        x[d + half] = hi * cos[d + half] + lo * sin[d + half];
    }
}

/* Attention over a forward's (row, head) pairs: key j of token i of row b is visible if j < start
 * (the committed prefix) or, rel = j - start, the tree mask allows rel (causal without one:
 * rel <= i). */
typedef struct {
    const float *qkv;
    float *att, *scores;
    int64_t scores_stride, query_stride;  /* a part's scores buffers; one query's in it: scores, then its sums */
    const int64_t *rows;
    int64_t T, QKV, nq, nkv, hd, group;
    float scale;
    const float *kc, *vc;
    int64_t slot_stride;
    const int64_t *slots, *starts;
    int64_t W;
    const uint8_t *tree_mask;
    int64_t R;
    const int64_t *chunks, *chunk_off;  /* `make_chunks` */
    int64_t n_chunks;
} Attention;

#if VW == 16
/* The 16 sums of 16 vectors, each in hsum16's order (halves, then quarters, then (0 + 2) + (1 + 3)),
 * as one vector: 15 vector additions and 30 shuffles, where 16 hsum16s take 32 vector and 48
 * scalar additions and 64 shuffles and extractions */
static inline vf hsum_block(const vf *v) {
    v16 s1[8], s2[4], s3[2];
    for (int m = 0; m < 8; m++)  /* [key 2m: 8 partials, key 2m + 1: 8] */
        s1[m] = __builtin_shufflevector(v[2 * m], v[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(v[2 * m], v[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int m = 0; m < 4; m++)  /* 4 keys x 4 */
        s2[m] = __builtin_shufflevector(s1[2 * m], s1[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(s1[2 * m], s1[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int m = 0; m < 2; m++)  /* 8 keys x (0 + 2, 1 + 3) */
        s3[m] = __builtin_shufflevector(s2[2 * m], s2[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(s2[2 * m], s2[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(s3[0], s3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(s3[0], s3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
/* The 8 sums of 8 vectors, each in hsumv's order (halves, then (0 + 2) + (1 + 3)), as one vector */
static inline vf hsum_block(const vf *v) {
    v8 s1[4], s2[2];
    for (int m = 0; m < 4; m++)  /* [key 2m: 4 partials, key 2m + 1: 4] */
        s1[m] = __builtin_shufflevector(v[2 * m], v[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(v[2 * m], v[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int m = 0; m < 2; m++)  /* 4 keys x (0 + 2, 1 + 3) */
        s2[m] = __builtin_shufflevector(s1[2 * m], s1[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
                __builtin_shufflevector(s1[2 * m], s1[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(s2[0], s2[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(s2[0], s2[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* A query's products with key k, summed over its VW-float parts: the one computation of a
 * score before its horizontal sum, so a key scored VW at a time or alone gets the same bits */
static inline __attribute__((always_inline)) vf products(const vf *qv, const float *k, int64_t ne) {
    vf acc = qv[0] * ldv(k);
    for (int64_t e = 1; e < ne; e++) acc += qv[e] * ldv(k + VW * e);
    return acc;
}

/* The scores of keys k, k + step, ..., k + (VW - 1) step for one query (one block: `hsum_block`,
 * each lane the bits `hsumv` gives that key alone) */
static inline __attribute__((always_inline)) vf score_block(const vf *qv, const float *k, int64_t step, float scale,
                                                            int64_t ne) {
    vf acc[VW];
    for (int64_t u = 0; u < VW; u++) acc[u] = products(qv, k + u * step, ne);
    return hsum_block(acc) * scale;
}

/* Queries of one row and one key-value head, attended together (`attend_chunk`): each block of keys
 * is scored for every query while it is in L1, and each tile of values weighed into every query's
 * sums while it is. One pair at a time, each pair streamed its row's keys and values from L2 or
 * further again, though a group's heads and a verification's tokens read the same ones (~12 cycles
 * a key and head; chunked, a 5-token verification's attention took 0.7-0.9x the time, C harness). */
#define ATT_QUERIES 16  /* a chunk's queries, at most: each has a scores buffer of its own */
#define ATT_TILE 64     /* keys whose values stay in L1 while every query of a chunk weighs them (even) */
#define ATT_TOKENS 3    /* a row's tokens, at least, for its queries to go in chunks: fewer share too
                         * little (in chunks, batches of 8 rows of one or two tokens ran 0.95-0.97x) */

/* A forward's attention in chunks of pairs (r, h), each chunk's in `pairs` from off[c] to off[c + 1];
 * returns their count. For each row b and key-value head g, the queries of b's tokens at g's
 * heads: split into equal chunks of at most ATT_QUERIES, or one chunk per pair where b has fewer
 * than ATT_TOKENS tokens. Made once a forward: every layer has the same. */
static int64_t make_chunks(const int64_t *rows, int64_t R, int64_t T, int64_t nq, int64_t nkv, int64_t group,
                           int64_t *pairs, int64_t *off) {
    int64_t c = 0, k = 0;
    off[0] = 0;
    for (int64_t r = 0; r < R;) {
        int64_t end = r + 1;
        while (end < R && rows[end] / T == rows[r] / T) end++;
        int64_t n = (end - r) * group, per = end - r < ATT_TOKENS ? n : (n + ATT_QUERIES - 1) / ATT_QUERIES;
        int64_t size = (n + per - 1) / per;
        for (int64_t g = 0; g < nkv; g++)
            for (int64_t first = 0; first < n; first += size) {
                for (int64_t q = first; q < first + size && q < n; q++)
                    pairs[k++] = (r + q / group) * nq + g * group + q % group;
                off[++c] = k;
            }
        r = end;
    }
    return c;
}

/* Scores of keys `from` .. len of one query (row r, token i; `from` a multiple of VW): VW at a
 * time while all are visible, then one at a time, those past start tested for visibility; then
 * the softmax over all its scores (those before `from` already in sc, their lanes' maxima in
 * top): the weights in sc, zero for hidden keys. Returns 1 / their sum, their maximum in m
 * (-INFINITY where no key is visible: then 0). */
static inline __attribute__((always_inline)) float softmax_scores(const Attention *a, int64_t r, const vf *qv,
                                                                  const float *ks, float *sc, int64_t from, vf top,
                                                                  int64_t start, int64_t len, float *m, int64_t ne) {
    const int64_t i = a->rows[r] % a->T, step = a->nkv * a->hd;
    const uint8_t *tm = a->tree_mask ? a->tree_mask + a->rows[r] * a->W : NULL;
    /* keys before `visible` are all visible: the committed prefix, and a causal query's own and
     * earlier ones (a prompt's); those go VW at a time */
    int64_t j = from, visible = tm ? start : start + i + 1;
    for (; j + VW <= visible; j += VW) {
        vf s = score_block(qv, ks + j * step, step, a->scale, ne);
        stv(sc + j, s);
        top = sel(s > top, s, top);
    }
    *m = -INFINITY;
    for (int u = 0; u < VW; u++) *m = top[u] > *m ? top[u] : *m;
    for (; j < len; j++) {
        if (j >= start && !(tm ? tm[j - start] : j - start <= i)) { sc[j] = -INFINITY; continue; }
        float s = hsumv(products(qv, ks + j * step, ne)) * a->scale;
        sc[j] = s;
        *m = s > *m ? s : *m;
    }
    if (*m == -INFINITY) return 0.0f;
    for (int64_t j = len; j % VW; j++) sc[j] = -INFINITY;
    vf total = {0};
    for (int64_t j = 0; j < len; j += VW) {  /* hidden keys weigh exactly 0 */
        vf x = ldv(sc + j);
        vf p = sel(x > -INFINITY, expv(x - *m), (vf){0});
        stv(sc + j, p);
        total += p;
    }
    return 1.0f / hsumv(total);
}

/* Values of keys t .. end - 1 (t even) weighed by sc into the even and odd keys' sums */
static inline __attribute__((always_inline)) void weigh_values(vf *even, vf *odd, const float *sc, const float *vs,
                                                               int64_t t, int64_t end, int64_t step, int64_t ne) {
    for (int64_t j = t; j + 1 < end; j += 2) {
        const float *v = vs + j * step;
        vf p0 = bcastv(sc[j]), p1 = bcastv(sc[j + 1]);
        for (int64_t e = 0; e < ne; e++) {
            even[e] += p0 * ldv(v + VW * e);
            odd[e] += p1 * ldv(v + step + VW * e);
        }
    }
}

/* The output of a query: its last key, if unpaired, with the even ones, then (even + odd) / sum */
static inline __attribute__((always_inline)) void write_output(float *o, vf *even, const vf *odd, const float *sc,
                                                               const float *vs, int64_t len, int64_t step,
                                                               float inv, int64_t ne) {
    if (len % 2) {
        vf p0 = bcastv(sc[len - 1]);
        for (int64_t e = 0; e < ne; e++) even[e] += p0 * ldv(vs + (len - 1) * step + VW * e);
    }
    for (int64_t e = 0; e < ne; e++) stv(o + VW * e, (even[e] + odd[e]) * inv);
}

/* One (row, head) pair's attention, with hd = VW ne (ne a constant where `attention_part` inlines
 * it), in registers throughout: a row's of fewer than ATT_TOKENS tokens. Scores first
 * (`softmax_scores`: VW keys at a time while all are visible, with no visibility test), then the
 * weighted sum of values over even and odd keys apart, in key order (added at the end). Summed in
 * memory, key after key, each key waited for the last one's store, and at 256 keys of context a
 * 5-token verification's attention took longer than its matmuls. Every pair is computed in this
 * order whatever else is in the forward (`attend_chunk` too). */
static inline __attribute__((always_inline)) void attend(const Attention *a, int64_t pair, float *scores, int64_t ne) {
    const int64_t nq = a->nq, hd = a->hd, step = a->nkv * hd;
    int64_t r = pair / nq, h = pair % nq, b = a->rows[r] / a->T, g = h / a->group;
    int64_t start = a->starts[b], len = start + a->W;
    const float *ks = a->kc + a->slots[b] * a->slot_stride + g * hd, *vs = a->vc + a->slots[b] * a->slot_stride + g * hd;
    float *o = a->att + r * nq * hd + h * hd, m;
    vf qv[512 / VW];
    for (int64_t e = 0; e < ne; e++) qv[e] = ldv(a->qkv + r * a->QKV + h * hd + VW * e);
    float inv = softmax_scores(a, r, qv, ks, scores, 0, (vf){0} - INFINITY, start, len, &m, ne);
    if (m == -INFINITY) { memset(o, 0, hd * sizeof(float)); return; }
    vf even[512 / VW], odd[512 / VW];
    for (int64_t e = 0; e < ne; e++) even[e] = odd[e] = (vf){0};
    weigh_values(even, odd, scores, vs, 0, len, step, ne);
    write_output(o, even, odd, scores, vs, len, step, inv, ne);
}

/* The attention of n pairs of one row and key-value head (a chunk, `make_chunks`), each as
 * `attend` computes it alone (the same numbers), tiled: each block of VW keys is scored for every
 * query while in L1, and each ATT_TILE keys' values weighed into every query's sums while in L1
 * (the sums kept after each query's scores between tiles). */
static inline __attribute__((always_inline)) void attend_chunk(const Attention *a, const int64_t *pairs, int n,
                                                               float *scores, int64_t ne) {
    const int64_t nq = a->nq, hd = a->hd, step = a->nkv * hd, stride = a->query_stride;
    int64_t b = a->rows[pairs[0] / nq] / a->T, g = pairs[0] % nq / a->group;
    int64_t start = a->starts[b], len = start + a->W, blocked = start / VW * VW;
    const float *ks = a->kc + a->slots[b] * a->slot_stride + g * hd, *vs = a->vc + a->slots[b] * a->slot_stride + g * hd;
    float mx[ATT_QUERIES], inv[ATT_QUERIES];
    vf top[ATT_QUERIES], qvs[ATT_QUERIES][512 / VW];
    for (int q = 0; q < n; q++) {
        top[q] = (vf){0} - INFINITY;
        for (int64_t e = 0; e < ne; e++) qvs[q][e] = ldv(a->qkv + pairs[q] / nq * a->QKV + pairs[q] % nq * hd + VW * e);
    }
    for (int64_t j = 0; j < blocked; j += VW)
        for (int q = 0; q < n; q++) {
            vf s = score_block(qvs[q], ks + j * step, step, a->scale, ne);
            stv(scores + q * stride + j, s);
            top[q] = sel(s > top[q], s, top[q]);
        }
    for (int q = 0; q < n; q++) {
        inv[q] = softmax_scores(a, pairs[q] / nq, qvs[q], ks, scores + q * stride, blocked, top[q], start, len, &mx[q], ne);
        for (int64_t e = 0; e < 2 * ne; e++) stv(scores + (q + 1) * stride - 2 * hd + VW * e, (vf){0});
    }
    for (int64_t t = 0; t < len; t += ATT_TILE) {
        int64_t end = t + ATT_TILE < len ? t + ATT_TILE : len;
        for (int q = 0; q < n; q++) {
            if (mx[q] == -INFINITY) continue;
            float *sums = scores + (q + 1) * stride - 2 * hd;
            vf even[512 / VW], odd[512 / VW];
            for (int64_t e = 0; e < ne; e++) even[e] = ldv(sums + VW * e), odd[e] = ldv(sums + hd + VW * e);
            weigh_values(even, odd, scores + q * stride, vs, t, end, step, ne);
            for (int64_t e = 0; e < ne; e++) stv(sums + VW * e, even[e]), stv(sums + hd + VW * e, odd[e]);
        }
    }
    for (int q = 0; q < n; q++) {
        float *o = a->att + pairs[q] / nq * nq * hd + pairs[q] % nq * hd, *sums = scores + (q + 1) * stride - 2 * hd;
        if (mx[q] == -INFINITY) { memset(o, 0, hd * sizeof(float)); continue; }
        vf even[512 / VW], odd[512 / VW];
        for (int64_t e = 0; e < ne; e++) even[e] = ldv(sums + VW * e), odd[e] = ldv(sums + hd + VW * e);
        write_output(o, even, odd, scores + q * stride, vs, len, step, inv[q], ne);
    }
}

/* Some of a forward's chunks (`make_chunks`): part p of a parallel section takes chunks
 * p n / parts .. (p + 1) n / parts, with its own scores buffers; head sizes of 32, 64 and 128 get
 * their own code. */
static void attention_part(void *arg, int part, int parts) {
    const Attention *a = arg;
    const int64_t n = a->n_chunks, ne = a->hd / VW;
    float *scores = a->scores + part * a->scores_stride;
    for (int64_t c = n * part / parts; c < n * (part + 1) / parts; c++) {
        const int64_t *pairs = a->chunks + a->chunk_off[c];
        int k = (int)(a->chunk_off[c + 1] - a->chunk_off[c]);
        if (k == 1)
            switch (a->hd) {
            case 32: attend(a, pairs[0], scores, 32 / VW); break;
            case 64: attend(a, pairs[0], scores, 64 / VW); break;
            case 128: attend(a, pairs[0], scores, 128 / VW); break;
            default: attend(a, pairs[0], scores, ne);
            }
        else
            switch (a->hd) {
            case 32: attend_chunk(a, pairs, k, scores, 32 / VW); break;
            case 64: attend_chunk(a, pairs, k, scores, 64 / VW); break;
            case 128: attend_chunk(a, pairs, k, scores, 128 / VW); break;
            default: attend_chunk(a, pairs, k, scores, ne);
            }
    }
}

/* Returns 0, or a negative code for input it cannot run (native/__init__.py never passes such).
 * Padding (row b's tokens from lengths[b] on) is not computed: the real tokens are moved to the
 * front of x, the layers run over them alone, and they go back to their rows; a padded token's
 * output is zero. A batch whose rows draft different lengths is padded to the longest, and at
 * batch 8 computing the padding made 2 rows drafting 4 tokens cost 40 tokens instead of 16. */
int specdec_decoder_forward(
    const Decoder *d, float *x, int64_t B, int64_t T,
    const int64_t *positions,            /* [B, T] */
    const float *cos, const float *sin,  /* [n, hd]: rotary rows per position */
    float *k_cache, float *v_cache,      /* [layers, slots, capacity + 1, nkv, hd] */
    int64_t layer_stride, int64_t slot_stride,
    const int64_t *slots, const int64_t *starts,
    const int64_t *lengths,              /* [B] real tokens per row, or NULL: all T */
    const uint8_t *tree_mask, int64_t W  /* [B, T, W] or NULL (then W == T: causal) */
) {
    const int64_t H = d->hidden, nq = d->n_heads, nkv = d->n_kv, hd = d->head_dim, I = d->inter;
    const int64_t QKV = (nq + 2 * nkv) * hd, group = nq / nkv;
    if (hd > 512 || hd % 16 || H % 16 || I % 16) return -1;
    const float scale = 1.0f / sqrtf((float)hd);
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = starts[b] + W > max_len ? starts[b] + W : max_len;
    /* real token n sits at row rows[n] = b T + i; then attention's chunks (`make_chunks`) */
    int64_t *rows = malloc(sizeof(int64_t) * (B * T + 2 * B * T * nq + 1));
    if (!rows) return -2;
    int64_t R = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < (lengths ? lengths[b] : T); i++) rows[R++] = b * T + i;
    int64_t *chunk_pairs = rows + B * T, *chunk_off = chunk_pairs + B * T * nq;
    const int64_t n_chunks = make_chunks(rows, R, T, nq, nkv, group, chunk_pairs, chunk_off);
    int parts = pool.threads;  /* attention's parts: scores buffers for a chunk's queries each */
    const int64_t chunk = T * group < ATT_QUERIES ? T * group : ATT_QUERIES, query_stride = max_len + 16 + 2 * hd;
    float *buf = malloc(sizeof(float) * (R * H + R * QKV + R * nq * hd + R * 2 * I + R * I + parts * chunk * query_stride));
    if (!buf) { free(rows); return -2; }
    float *xn = buf, *qkv = xn + R * H, *att = qkv + R * QKV, *gu = att + R * nq * hd, *act = gu + R * 2 * I;
    float *scores = act + R * I;
    for (int64_t n = 0; n < R; n++)  /* rows[n] >= n: in order, nothing is overwritten before it moves */
        if (rows[n] != n) memcpy(x + n * H, x + rows[n] * H, H * sizeof(float));

    int rc = 0;
    for (int32_t l = 0; l < d->n_layers; l++) {
        const Layer *L = &d->layers[l];
        float *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
        for (int64_t r = 0; r < R; r++) {
            if (L->in_norm) rms_norm(x + r * H, L->in_norm, H, d->eps, xn + r * H);
            else memcpy(xn + r * H, x + r * H, H * sizeof(float));
        }
        if ((rc = matmul(d, xn, R, H, L->qkv, L->qkv_bias, QKV, qkv))) break;
        /* rotary on queries and keys, then keys and values into their slots */
        for (int64_t r = 0; r < R; r++) {
            int64_t b = rows[r] / T, i = rows[r] % T, p = positions[rows[r]];
            float *row = qkv + r * QKV;
            for (int64_t h = 0; h < nq + nkv; h++) rope(row + h * hd, cos + p * hd, sin + p * hd, hd);
            int64_t off = slots[b] * slot_stride + (starts[b] + W - T + i) * nkv * hd;
            memcpy(kc + off, row + nq * hd, nkv * hd * sizeof(float));
            memcpy(vc + off, row + (nq + nkv) * hd, nkv * hd * sizeof(float));
        }
        Attention job = {qkv, att, scores, chunk * query_stride, query_stride, rows, T, QKV, nq, nkv, hd, group, scale,
                         kc, vc, slot_stride, slots, starts, W, tree_mask, R, chunk_pairs, chunk_off, n_chunks};
        parallel(attention_part, &job, (int)(n_chunks < parts ? n_chunks : parts));
        if ((rc = matmul(d, att, R, nq * hd, L->o, L->o_bias, H, xn))) break;
        for (int64_t n = 0; n < R * H; n++) x[n] += xn[n];
        for (int64_t r = 0; r < R; r++) rms_norm(x + r * H, L->post_norm, H, d->eps, xn + r * H);
        if ((rc = matmul(d, xn, R, H, L->gate_up, NULL, 2 * I, gu))) break;
        for (int64_t r = 0; r < R; r++)
            for (int64_t n = 0; n < I; n += VW) {  /* SiLU(gate) * up */
                vf g = ldv(gu + r * 2 * I + n);
                stv(act + r * I + n, g / (1.0f + expv((vf){0} - g)) * ldv(gu + r * 2 * I + I + n));
            }
        if ((rc = matmul(d, act, R, I, L->down, NULL, H, xn))) break;
        for (int64_t n = 0; n < R * H; n++) x[n] += xn[n];
    }
    if (d->final_norm)
        for (int64_t r = 0; r < R; r++) {
            rms_norm(x + r * H, d->final_norm, H, d->eps, xn);
            memcpy(x + r * H, xn, H * sizeof(float));
        }
    for (int64_t n = R - 1, next = B * T; n >= 0; n--) {  /* back to their rows, from the last; padding 0 */
        if (rows[n] + 1 < next) memset(x + (rows[n] + 1) * H, 0, (next - rows[n] - 1) * H * sizeof(float));
        if (rows[n] != n) memcpy(x + rows[n] * H, x + n * H, H * sizeof(float));
        next = rows[n];
    }
    if (R == 0) memset(x, 0, B * T * H * sizeof(float));
    else if (rows[0] > 0) memset(x, 0, rows[0] * H * sizeof(float));
    free(buf);
    free(rows);
    return rc;
}

/* A chain drafter's output head and input (`native/__init__.py`'s `NativeChain`). */
typedef struct {
    const float *embed;   /* [V, H]: token embeddings */
    const void *head;     /* [H, V] blocked: the output head */
    int32_t head_wtype;
    int64_t vocab;
    const void *fc;       /* [2 H, H] blocked, or NULL: EAGLE's projection of (embedding, feature) */
    const float *fc_bias; /* [H] or NULL */
    int32_t fc_wtype;
} Chain;

/* The first index of a row's largest logit, as torch's argmax (a NaN counts as the largest),
 * skipping the EOS ids where `mask`: a sequence still owing min_tokens may not draft them. */
static int64_t argmax_row(const float *l, int64_t V, const int64_t *eos, int64_t n_eos, int mask) {
    int64_t best = -1;
    float top = 0;
    for (int64_t i = 0; i < V; i++) {
        int skip = 0;
        for (int64_t e = 0; mask && e < n_eos; e++) skip |= eos[e] == i;
        if (skip) continue;
        if (best < 0 || l[i] > top || (l[i] != l[i] && top == top)) best = i, top = l[i];
        if (top != top) break;
    }
    return best < 0 ? 0 : best;
}

/* A chain drafter's forward input for token `tok`: its embedding into x, or (with `fc`) the
 * embedding and `feature` side by side into cat, which fc projects (cat NULL without fc). */
static void chain_input(const Chain *c, int64_t tok, const float *feature, int64_t H, float *x, float *cat) {
    if (c->fc) {
        memcpy(cat, c->embed + tok * H, H * sizeof(float));
        memcpy(cat + H, feature, H * sizeof(float));
    } else {
        memcpy(x, c->embed + tok * H, H * sizeof(float));
    }
}

/* A greedy chain drafter's proposal in one call: its catch-up, then its chains. Row b feeds its
 * lengths[b] pending entries (`tokens` [B, T], right-padded; with `fc`, EAGLE-1's, each paired
 * with a true feature: pairs[n] its H floats, n counting the entries of every row in order) at
 * window positions starts[b] .. (as `proposers.base.window_positions`) of slot slots[b], then
 * drafts ks[b] tokens (0: it only catches up): each the argmax of the output head over the
 * forward before, the next fed one position further. Without `fc` (a draft model) a forward's
 * input is the token's embedding and its output goes through the decoder's final norm; with it
 * the input is fc(embedding, feature) and the output is the next feature. Row b's draft token at
 * depth j (1 = right after the root) skips the EOS ids while j <= eos_until[b]. out [B, max ks]:
 * row b's draft tokens. Each forward and head matmul is the one the proposer's Python ran, so
 * tokens and cache entries are its own bit for bit; what goes is the Python around them (a draft
 * model's one-token step was ~0.1 ms of it around a ~0.02 ms forward). */
int specdec_greedy_draft(
    const Decoder *d, const Chain *c, int64_t B, int64_t T,
    const int64_t *tokens, const int64_t *lengths, const int64_t *starts, const float *const *pairs,
    const int64_t *ks, const float *cos, const float *sin, float *k_cache, float *v_cache,
    int64_t layer_stride, int64_t slot_stride, const int64_t *slots,
    const int64_t *eos_until, const int64_t *eos, int64_t n_eos, int64_t *out
) {
    const int64_t H = d->hidden, V = c->vocab;
    int64_t M = 0, R = 0;
    for (int64_t b = 0; b < B; b++) {
        M = ks[b] > M ? ks[b] : M;
        if (lengths[b] < 1 || lengths[b] > T) return -1;
        R += lengths[b];
    }
    if (V % 16 || (c->fc == NULL) != (pairs == NULL)) return -1;
    int64_t *idx = malloc(sizeof(int64_t) * (B * T + 3 * B + 3));
    float *buf = malloc(sizeof(float) * (B * T * H + (c->fc ? R * 3 * H : 0) + 2 * B * H + B * V + 16));
    if (!idx || !buf) { free(idx); free(buf); return -2; }
    int64_t *pos = idx, *rows = pos + B * T, *row_pos = rows + B + 1, *row_slots = row_pos + B + 1;
    float *x = buf, *feature = x + B * T * H, *h = feature + B * H, *logits = h + B * H, *cat = logits + B * V;
    int rc = 0;
    /* the catch-up: every row's pending entries in one forward */
    for (int64_t b = 0, n = 0; b < B && rc == 0; b++)
        for (int64_t i = 0; i < lengths[b]; i++, n++) {
            int64_t tok = tokens[b * T + i];
            pos[b * T + i] = starts[b] + i;
            if (tok < 0 || tok >= V) { rc = -3; break; }
            chain_input(c, tok, c->fc ? pairs[n] : NULL, H, x + (b * T + i) * H, c->fc ? cat + n * 2 * H : NULL);
        }
    if (rc == 0 && c->fc) {
        float *projected = cat + R * 2 * H;
        rc = matmul_any(c->fc_wtype, cat, R, 2 * H, c->fc, c->fc_bias, H, projected);
        for (int64_t b = 0, n = 0; b < B; n += lengths[b], b++)
            memcpy(x + b * T * H, projected + n * H, lengths[b] * H * sizeof(float));
    }
    if (rc == 0)
        rc = specdec_decoder_forward(d, x, B, T, pos, cos, sin, k_cache, v_cache, layer_stride, slot_stride,
                                     slots, starts, lengths, NULL, T);
    for (int64_t b = 0; b < B && rc == 0; b++)  /* each row's last output: its next feature (EAGLE) */
        memcpy(feature + b * H, x + (b * T + lengths[b] - 1) * H, H * sizeof(float));
    /* then the chains: depth j's token from the forward of depth j - 1's (the catch-up's at j = 1) */
    for (int64_t j = 1; j <= M && rc == 0; j++) {
        int64_t n = 0;
        for (int64_t b = 0; b < B; b++)
            if (ks[b] >= j) rows[n] = b, row_pos[n] = starts[b] + lengths[b] + j - 2, row_slots[n] = slots[b], n++;
        if (j > 1) {
            for (int64_t r = 0; r < n; r++)
                chain_input(c, out[rows[r] * M + j - 2], feature + rows[r] * H, H, h + r * H, c->fc ? cat + r * 2 * H : NULL);
            if (c->fc && (rc = matmul_any(c->fc_wtype, cat, n, 2 * H, c->fc, c->fc_bias, H, h))) break;
            rc = specdec_decoder_forward(d, h, n, 1, row_pos, cos, sin, k_cache, v_cache, layer_stride,
                                         slot_stride, row_slots, row_pos, NULL, NULL, 1);
            if (rc) break;
            for (int64_t r = 0; r < n; r++) memcpy(feature + rows[r] * H, h + r * H, H * sizeof(float));
        } else {
            for (int64_t r = 0; r < n; r++) memcpy(h + r * H, feature + rows[r] * H, H * sizeof(float));
        }
        if ((rc = matmul_any(c->head_wtype, h, n, H, c->head, NULL, V, logits))) break;
        for (int64_t r = 0; r < n; r++) {
            int64_t b = rows[r];
            out[b * M + j - 1] = argmax_row(logits + r * V, V, eos, n_eos, j <= eos_until[b]);
        }
    }
    free(buf);
    free(idx);
    return rc;
}

/* The real tokens of a [B, T] batch (lengths[b] real in row b, or NULL: all T); -1 where a
 * length is out of range. */
static int64_t real_tokens(int64_t B, int64_t T, const int64_t *lengths) {
    int64_t R = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t n = lengths ? lengths[b] : T;
        if (n < 0 || n > T) return -1;
        R += n;
    }
    return R;
}

/* A target's step in one call: each real token's embedding (`tokens` [B, T], right-padded,
 * lengths[b] real in row b, or NULL: all T), the decoder forward as `specdec_decoder_forward`
 * (causal, or under tree_mask [B, T, W]) into x [B, T, H] (padding zero), then the output head
 * of every real token, in row order, into logits [R, V]. Its matmuls and forward are the ones the
 * engine's step ran through torch and `specdec_matmul`, so hidden states and logits are the same
 * bit for bit; what goes is the Python and the operator calls around them (the embedding, the
 * head's call, the input tensors: ~0.1 ms of a ~0.4 ms plain step of the demo kit's target at
 * batch 1, most of it in caches the forward had just evicted). */
static int step_logits(
    const Decoder *d, const Chain *c, int64_t B, int64_t T, const int64_t *tokens, const int64_t *positions,
    const float *cos, const float *sin, float *k_cache, float *v_cache, int64_t layer_stride,
    int64_t slot_stride, const int64_t *slots, const int64_t *starts, const int64_t *lengths,
    const uint8_t *tree_mask, int64_t W, float *x, int64_t R, float *logits
) {
    const int64_t H = d->hidden, V = c->vocab;
    for (int64_t b = 0; b < B; b++) {
        int64_t n = lengths ? lengths[b] : T;
        for (int64_t i = 0; i < n; i++) {
            int64_t tok = tokens[b * T + i];
            if (tok < 0 || tok >= V) return -3;
            memcpy(x + (b * T + i) * H, c->embed + tok * H, H * sizeof(float));
        }
    }
    int rc = specdec_decoder_forward(d, x, B, T, positions, cos, sin, k_cache, v_cache, layer_stride,
                                     slot_stride, slots, starts, lengths, tree_mask, W);
    if (rc) return rc;
    float *h = malloc(sizeof(float) * R * H);
    if (!h) return -2;
    for (int64_t b = 0, n = 0; b < B; b++) {  /* the real tokens' outputs, in order */
        int64_t m = lengths ? lengths[b] : T;
        memcpy(h + n * H, x + b * T * H, m * H * sizeof(float));
        n += m;
    }
    rc = matmul_any(c->head_wtype, h, R, H, c->head, NULL, V, logits);
    free(h);
    return rc;
}

/* A target's whole step, `step_logits`: the logits [R, V] into `logits` (a step whose rows
 * sample: the caller applies each row's transform and draws or accepts from them), and/or their
 * argmax, in row order, into `out` (a greedy step; NULL: none). NULL logits: kept here. */
int specdec_target_step(
    const Decoder *d, const Chain *c, int64_t B, int64_t T, const int64_t *tokens, const int64_t *positions,
    const float *cos, const float *sin, float *k_cache, float *v_cache, int64_t layer_stride,
    int64_t slot_stride, const int64_t *slots, const int64_t *starts, const int64_t *lengths,
    const uint8_t *tree_mask, int64_t W, float *x, float *logits, int64_t *out
) {
    const int64_t V = c->vocab, R = real_tokens(B, T, lengths);
    if (V % 16 || c->fc || R < 0) return -1;
    float *buf = logits ? logits : malloc(sizeof(float) * R * V);
    if (!buf) return -2;
    int rc = step_logits(d, c, B, T, tokens, positions, cos, sin, k_cache, v_cache, layer_stride, slot_stride,
                         slots, starts, lengths, tree_mask, W, x, R, buf);
    if (!rc && out)
        for (int64_t n = 0; n < R; n++) out[n] = argmax_row(buf + n * V, V, NULL, 0, 0);
    if (!logits) free(buf);
    return rc;
}
