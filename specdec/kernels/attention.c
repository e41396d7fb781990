/* Batch-invariant attention for decode and verification steps (CPU, f32 or bf16 storage, f32 arithmetic).

   Each (query row, head) pair attends over its own cache slots, computed by the same instructions in the same order
   whatever the other rows are: row i of a verification forward over T tokens is bitwise the decode step that would
   compute that token alone. General attention kernels are not batch-invariant (they split and vectorize their
   reductions by the shape of the whole batch: "Defeating Nondeterminism in LLM Inference", He et al., Thinking
   Machines 2025); this one is, so speculative greedy output can never differ from plain greedy output, and a
   verification over T rows costs one call, not T.

   Per (row, head) pair: s_j = scale * q . k_j, p = softmax(s) (max, then exp and sum),
   o = sum_j p_j v_j / sum_j p_j.
   - scores: keys are kept in tiles of 32 slots, transposed (f32: kt [Hkv, tiles, D, 32]; bf16: [Hkv, tiles, D / 2,
     32, 2], each slot's dims in pairs; 4 KB read front to back per tile for D = 64, bf16), so 32 scores are computed
     together, each one chain of fused multiply-adds over d = 0..D-1 in a vector lane (with AVX-512 BF16, one chain
     of VDPBF16PS over the pairs of d, see tile_at); a slot's score is the same whichever tile, lane or batch of
     queries computes it, so any slot (a tree path's scattered tail slots too) is read from its tile in place;
   - exp: a branch-free Cephes polynomial, vectorized; the softmax sum keeps 16 lanes (key i of the part in lane
     i mod 16, in key order, padding masked to exact zeros) and adds them pairwise in a fixed order;
   - output: o[d] accumulates p_j v_j[d] over the keys in key order, vectorized over d (with AVX-512 BF16 and a bf16
     cache, two keys at a time with p rounded to bf16, as FlashAttention-2 does: values_pairs);
   - a row with SPLIT or more keys is cut in two halves at a point that depends only on its number of keys, each
     half computed as above (its own max, sum and output), then merged (flash-decoding's split-KV): two threads
     share one decode step, and a row's result still depends on that row alone.
   Loads are shared, arithmetic is not: one unit of work takes every pair of a KV head (its query heads, for each of
   a group of rows: a chain's or a tree's rows, one half of their keys), loads each key tile once for up to MAX_R
   pairs and each value row once for up to MAX_RV pairs, and updates each pair's own accumulators with that pair's
   own operations in its own order. So a verification over T rows costs far less than T decode steps (their keys and
   values are read and converted once), and each row is still bitwise its decode step: the tests check that.
   Written with GCC/clang vector extensions (fused multiply-adds explicit where the machine has them); build with
   -O3 -march=native -ffp-contract=fast. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#define W 16     /* floats per vector */
#define BLOCK 32  /* keys per block of scores: two vectors */
#define SPLIT 256 /* rows with this many keys or more are computed in two halves */
#ifndef UNIT_AHEAD /* key tiles (and value rows) of the next unit prefetched when a unit starts: a unit's first
                      tile was not, and a batch's units are short (8 sequences of 600 slots: 48 units a layer). On the
                      Zen 4 host, attention alone 1.04-1.07x at 600 x 8 / 1500 / 1000 x 4 slots, 4 tiles 0.99-1.07x
                      (docs/results/unit-ahead-1206h.txt) */
#define UNIT_AHEAD 2
#endif

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
typedef float vf_u __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vu_u __attribute__((vector_size(64), aligned(2)));

static inline vf load_f32(const float *p) { return *(const vf_u *)p; }

/* Where dim d of slot l (0..31) is in a key tile. f32: [D, 32], a dim's 32 slots side by side. bf16: [D / 2, 32, 2],
   the 32 slots' dims d, d + 1 (d even) side by side, so that 16 slots' pairs are one 64-byte vector: the operand of
   AVX-512 BF16's VDPBF16PS (BF16DOT), which adds both products of a lane's pair into its f32 score in one
   instruction, where the f32 chain takes two widenings and two fused multiply-adds (Zen 4: SmolLM2's attention at
   1000 cached slots 1.09x / 1.17x faster at T = 1 / 9, its forwards 1.03-1.06x at T = 2-9;
   docs/results/key-pairs-bf16-1206i.txt). Without it the pairs are split into dims d and d + 1 (keys_*), and every
   score is the same chain of fused multiply-adds over d = 0..D-1 as with [D, 32] tiles, bitwise. */
static inline long tile_at(int d, long l, int esize) {
    return esize == 2 ? ((long)(d >> 1) * 32 + l) * 2 + (d & 1) : (long)d * 32 + l;
}
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16DOT 1
#else
#define BF16DOT 0
#endif

static inline vf load_bf16(const uint16_t *p) {
    vu u = __builtin_convertvector(*(const vh *)p, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void store_f32(float *p, vf x) { *(vf_u *)p = x; }

static inline void store_bf16(uint16_t *p, vf x) { /* round to nearest even, as torch does (no NaN here) */
    vu u;
    memcpy(&u, &x, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    *(vh *)p = __builtin_convertvector(u >> 16, vh);
}

static inline vf splat(float x) { return x - (vf){0}; } /* x in every lane (x - +0 is x, -0 included) */

/* a * b + c, rounded once. Explicit where the machine has the instruction: the same (row, head) is computed by
   different instantiations (by how many pairs share its loads, with or without a range test), and a contraction
   left to the compiler is not guaranteed in every one of them. */
static inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    __m256 x[2], y[2], z[2];
    memcpy(x, &a, sizeof a), memcpy(y, &b, sizeof b), memcpy(z, &c, sizeof c);
    x[0] = _mm256_fmadd_ps(x[0], y[0], z[0]), x[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
    memcpy(&a, x, sizeof a);
    return a;
#else
    return a * b + c; /* contracted by -ffp-contract=fast where the machine has a fused multiply-add */
#endif
}

/* mask ? a : b, lane by lane (mask lanes are 0 or -1); SELECT(vselect8, ...) below: the same for 8 lanes */
#define SELECT(NAME, VF, VI)                                                                                       \
    static inline VF NAME(VI mask, VF a, VF b) {                                                                   \
        VI ia, ib;                                                                                                 \
        memcpy(&ia, &a, sizeof ia);                                                                                \
        memcpy(&ib, &b, sizeof ib);                                                                                \
        VI r = (mask & ia) | (~mask & ib);                                                                         \
        VF f;                                                                                                      \
        memcpy(&f, &r, sizeof f);                                                                                  \
        return f;                                                                                                  \
    }
SELECT(vselect, vf, vi)

/* exp(x) for x <= 0 (scores minus their max): 2^n * P(r), |r| <= ln2 / 2, relative error ~2e-7. One body for
   16-lane vectors and (exp_nonpos8, AVX2 without AVX-512: GCC keeps 16-lane vectors on the stack there) 8-lane ones:
   the same operations lane by lane, so the same results. */
#define EXP_NONPOS(NAME, VF, VI, SELECT)                                                                           \
    static inline VF NAME(VF x) {                                                                                  \
        VF lo = (VF){0} - 87.0f;                                                                                   \
        x = SELECT(x < lo, lo, x);                                                                                 \
        VF t = x * 1.44269504088896341f + 0.5f;                                                                    \
        VF n = __builtin_convertvector(__builtin_convertvector(t, VI), VF); /* truncation toward zero... */        \
        n = SELECT(n > t, n - 1.0f, n);                                     /* ...made a floor (t may be < 0) */   \
        VF r = x - n * 0.693359375f + n * 2.12194440e-4f;                                                          \
        VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                                            \
        p = p * r + 8.3334519073e-3f;                                                                              \
        p = p * r + 4.1665795894e-2f;                                                                              \
        p = p * r + 1.6666665459e-1f;                                                                              \
        p = p * r + 5.0000001201e-1f;                                                                              \
        p = p * r * r + r + 1.0f;                                                                                  \
        VI e = (__builtin_convertvector(n, VI) + 127) << 23;                                                       \
        VF two_n;                                                                                                  \
        memcpy(&two_n, &e, sizeof two_n);                                                                          \
        return p * two_n;                                                                                          \
    }
#if defined(__AVX512F__) && !defined(EXP_GENERIC)
#include "vexp.h" /* its exp_nonpos: the operations of EXP_NONPOS in fewer instructions (a rounding for the floor, a
                      max for the clamp, VSCALEFPS for 2^n), bitwise the same on every float in [-104, 0]; attention
                      at T = 5 / 9 1.05x (docs/results/exp-vexp-1206i.txt; -DEXP_GENERIC builds the body above) */
static inline vf exp_vf(vf x) { return (vf)exp_nonpos((__m512)x); }
#else
EXP_NONPOS(exp_vf, vf, vi, vselect)
#endif

/* Two vectors from 32 consecutive elements, in an order of lanes that order_* puts back. f32: elements 0..15 and
   16..31. bf16: the 32 elements read as 16 pairs, the low halves shifted up (elements 0, 2, ..., 30) and the high
   halves masked (1, 3, ..., 31): one load and two cheap operations instead of two widening conversions. Every lane
   is computed on its own, so the order of lanes changes no result. */
static inline void pair_f32(const float *p, vf *x0, vf *x1) {
    *x0 = load_f32(p);
    *x1 = load_f32(p + W);
}

static inline void pair_bf16(const uint16_t *p, vf *x0, vf *x1) {
    vu u = *(const vu_u *)p, lo = u << 16, hi = u & 0xFFFF0000u;
    memcpy(x0, &lo, sizeof lo);
    memcpy(x1, &hi, sizeof hi);
}

/* Dims d and d + 1 (d even) of a key tile's 32 slots: x[0] = dim d of slots 0..15, x[1] of 16..31, x[2], x[3] the
   same for d + 1 (see tile_at). */
static inline void keys_f32(const float *kt, int d, vf *x) {
    pair_f32(kt + d * 32, x, x + 1);
    pair_f32(kt + (d + 1) * 32, x + 2, x + 3);
}

static inline void keys_bf16(const uint16_t *kt, int d, vf *x) {
    pair_bf16(kt + d * 32, x, x + 2);
    pair_bf16(kt + d * 32 + 32, x + 1, x + 3);
}

/* acc + VDPBF16PS: in each lane, the two products of k's bf16 pair (one slot's dims d, d + 1) with the query's pair
   q (a 32-bit word: dims d, d + 1), added into the f32 score (BF16DOT only) */
static inline vf dot_bf16(vf acc, vf k, const float *q) {
#if BF16DOT
    uint32_t w;
    memcpy(&w, q, sizeof w);
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)k, (__m512bh)_mm512_set1_epi32((int)w));
#else
    (void)k, (void)q;
    return acc;
#endif
}

static inline void order_f32(vf *a, vf *b) { (void)a, (void)b; }

static inline void order_bf16(vf *a, vf *b) { /* (even elements, odd elements) -> (0..15, 16..31) */
    const vi m0 = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const vi m1 = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    vf x = __builtin_shuffle(*a, *b, m0), y = __builtin_shuffle(*a, *b, m1);
    *a = x, *b = y;
}

/* CV vectors of one value row (CV = 1: 16 elements, else CV / 2 pairs) and their order put back. */
static inline __attribute__((always_inline)) void row_f32(const float *p, vf *x, const int CV) {
    for (int c = 0; c < CV; c++)
        x[c] = load_f32(p + c * W);
}

static inline __attribute__((always_inline)) void row_bf16(const uint16_t *p, vf *x, const int CV) {
    if (CV == 1)
        x[0] = load_bf16(p);
    else
        for (int c = 0; c < CV; c += 2)
            pair_bf16(p + c * W, x + c, x + c + 1);
}

#define ORDER_ROW(ORDER_, x, CV)                                                                                   \
    do {                                                                                                           \
        if ((CV) > 1)                                                                                              \
            for (int c_ = 0; c_ < (CV); c_ += 2)                                                                   \
                ORDER_((x) + c_, (x) + c_ + 1);                                                                    \
    } while (0)

/* What one unit of work (a KV head, a half, a group of rows) computes for one of its (row, query head) pairs: the
   keys of its part are the slots a .. b - 1 (a stretch of its consecutive run), then ntail slots tail[0..ntail). */
typedef struct {
    const void *q; /* its query [D], in storage type */
    long a, b, ntail, v0; /* v0: the part's first key's place in its decode step's run (see values_pairs) */
    const int64_t *tail;
    uint32_t *w; /* its weights in bf16 pairs (values_pairs), where the outputs take that path */
    float *s;    /* scores by slot: s[slot - base], for the slots of the unit's interval */
    float *p;    /* the part's scores in key order (into s when there is no tail), then exp(s - max) */
    float *part; /* [Dv + 2]: max, sum, then sum_j exp(s_j - max) v_j */
} rowhead;

static inline float elem_f32(const float *p) { return *p; }
static inline float elem_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#define ELEM(p) _Generic((p), const float *: elem_f32, const uint16_t *: elem_bf16)(p) /* one element, as f32 */

/* A pair's scores in key order at rh->p: a tree path's run, then its tail, gathered from the unit's scores by slot
   (a chain's are already there) -> its number of keys. */
static inline long gather_scores(rowhead *rh, long base) {
    long run = rh->b - rh->a;
    float *sg = rh->p;
    if (rh->ntail) {
        memcpy(sg, rh->s + rh->a - base, sizeof(float) * run);
        for (long i = 0; i < rh->ntail; i++)
            sg[run + i] = rh->s[rh->tail[i] - base];
    }
    return run + rh->ntail;
}

/* One pair's softmax part: its scores in key order (a tree path's gathered from the unit's scores by slot), their
   max, exp(s - max) in place and its sum -> part[0], part[1]. The sum keeps 16 lanes (key i in lane i mod 16, the
   padding of the last vector masked to exact zeros), added pairwise in a fixed order. */
#if defined(__AVX512F__) || !defined(__AVX2__) || !defined(__FMA__)
static void softmax_part(rowhead *rh, long base) {
    long n = gather_scores(rh, base), full = n / W * W;
    float *sg = rh->p;
    const vf iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vf mv = (vf){0} - 3.0e38f;
    vi tail = iota + (float)full < (float)n; /* the keys of the last, partial vector */
    for (long j = 0; j < full; j += W) {     /* the max (order-free) */
        vf x = load_f32(sg + j);
        mv = vselect(x > mv, x, mv);
    }
    if (full < n) { /* padding masked out */
        vf x = vselect(tail, load_f32(sg + full), mv);
        mv = vselect(x > mv, x, mv);
    }
    float m = mv[0];
    for (int l = 1; l < W; l++)
        m = mv[l] > m ? mv[l] : m;
    vf sum = {0};
    for (long j = 0; j < full; j += W) {
        vf e = exp_vf(load_f32(sg + j) - m);
        store_f32(sg + j, e);
        sum += e;
    }
    if (full < n) {
        vf e = vselect(tail, exp_vf(load_f32(sg + full) - m), (vf){0});
        store_f32(sg + full, e);
        sum += e;
    }
    for (int w = W / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            sum[l] += sum[l + w];
    rh->part[0] = m;
    rh->part[1] = sum[0];
}
#else
/* AVX2: the same in two 8-lane halves (lanes 0..7 and 8..15 of each 16-lane vector above); perf: the 16-lane version
   took ~40% of an 8-row SmolLM2 chain's attention at 700 cached tokens here (docs/results/attention-softmax.txt). */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float vf8_u __attribute__((vector_size(32), aligned(4)));
SELECT(vselect8, vf8, vi8)
#include "vexp.h" /* exp_nonpos8: the operations of EXP_NONPOS (bitwise: every float in [-104, 0] checked), in
                      fewer instructions (a rounding for the floor, a max for the clamp): 1.02-1.04x at 300-1500
                      cached slots (docs/results/attention-t1-1206f.txt) */
static inline vf8 exp8(vf8 x) { return (vf8)exp_nonpos8((__m256)x); }
static inline vf8 load8(const float *p) { return *(const vf8_u *)p; }
static inline void store8(float *p, vf8 x) { *(vf8_u *)p = x; }

static void softmax_part(rowhead *rh, long base) {
    long n = gather_scores(rh, base), full = n / W * W;
    float *sg = rh->p;
    const vf8 iota = {0, 1, 2, 3, 4, 5, 6, 7};
    vf8 mv0 = (vf8){0} - 3.0e38f, mv1 = mv0;
    vi8 tail0 = iota + (float)full < (float)n, tail1 = iota + (float)(full + 8) < (float)n;
    for (long j = 0; j < full; j += W) {
        vf8 x0 = load8(sg + j), x1 = load8(sg + j + 8);
        mv0 = vselect8(x0 > mv0, x0, mv0), mv1 = vselect8(x1 > mv1, x1, mv1);
    }
    if (full < n) {
        vf8 x0 = vselect8(tail0, load8(sg + full), mv0), x1 = vselect8(tail1, load8(sg + full + 8), mv1);
        mv0 = vselect8(x0 > mv0, x0, mv0), mv1 = vselect8(x1 > mv1, x1, mv1);
    }
    mv0 = vselect8(mv1 > mv0, mv1, mv0);
    float m = mv0[0];
    for (int l = 1; l < 8; l++)
        m = mv0[l] > m ? mv0[l] : m;
    vf8 s0 = {0}, s1 = {0};
    for (long j = 0; j < full; j += W) {
        vf8 e0 = exp8(load8(sg + j) - m), e1 = exp8(load8(sg + j + 8) - m);
        store8(sg + j, e0), store8(sg + j + 8, e1);
        s0 += e0, s1 += e1;
    }
    if (full < n) {
        vf8 e0 = vselect8(tail0, exp8(load8(sg + full) - m), (vf8){0});
        vf8 e1 = vselect8(tail1, exp8(load8(sg + full + 8) - m), (vf8){0});
        store8(sg + full, e0), store8(sg + full + 8, e1);
        s0 += e0, s1 += e1;
    }
    s0 += s1; /* w = 8 of the 16-lane reduction, then 4, 2, 1 */
    for (int w = 4; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            s0[l] += s0[l + w];
    rh->part[0] = m;
    rh->part[1] = s0[0];
}
#endif

#if defined(__AVX512F__) || !defined(__AVX2__) || !defined(__FMA__)
#define MAX_R 12 /* (row, head) pairs whose scores are computed together: 24 accumulators */
#define MAX_RV 6 /* pairs whose outputs are accumulated together: 24 accumulators for 64 columns */
#else /* AVX2's 16 registers (see ATTEND_HOT below): 6 pairs x 16 keys or columns a pass, 12 accumulators (the
         6 x 16 shape of AVX2 sgemm micro-kernels), against 3 x 32 / 2 x 32 before: a key tile or value row widened
         from bf16 half as often per fused multiply-add, no spill; an 8-row SmolLM2 chain's attention at 700 cached
         slots 1.55x faster, 8 sequences' rows 1.28x (docs/results/attention-6x16.txt). 1-3 pairs (a decode step of
         a model with 3 query heads a KV head) run 3 x 32 instead, keeping 12 fused multiply-add chains in flight: with
         6 (3 x 16) they waited on the FMA latency (5 cycles on Zen 2; a values pass from L2 ran 1.2 FMAs a cycle),
         and a step's attention at 1500 cached slots took 1.17x as long (docs/results/attention-t1-1206f.txt) */
#ifndef MAX_R
#define MAX_R 6
#endif
#ifndef MAX_RV
#define MAX_RV 6
#endif
#ifndef SCORES_NK
#define SCORES_NK 2 /* vectors of 8 keys a pass of the scores (4: the whole 32-key tile) */
#endif
#ifndef VALUES_NV
#define VALUES_NV 2 /* vectors of 8 columns a pass of the outputs */
#endif
#endif

#if defined(__AVX512F__) || !defined(__AVX2__) || !defined(__FMA__)
/* The inner loops (scores, and the outputs' weighted sums of value rows) in 16-lane vectors. */
#define ATTEND_HOT(NAME, T_, KEYS_, ORDER_, ROW_)                                                                  \
    /* 32 scores (one key tile, see tile_at) for R queries qt [D][R] (f32; with BF16DOT, bf16 ones in pairs:       \
       [D / 2][R] 32-bit words) -> s[r][at .. at + 32) */                                                          \
    static inline __attribute__((always_inline)) void scores_##NAME(const int R, const float *qt, const T_ *kt,    \
                                                                    int D, float scale, rowhead *rh, long at) {    \
        vf a0[MAX_R], a1[MAX_R]; /* fixed sizes (not R): kept in registers */                                      \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) a0[r] = a1[r] = (vf){0};                              \
        if (BF16DOT && sizeof(T_) == 2)                                                                            \
            for (int d = 0; d < D; d += 2, qt += R) {                                                              \
                vf x[2];                                                                                           \
                memcpy(x, kt + d * 32, sizeof x);                                                                  \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                             \
                    a0[r] = dot_bf16(a0[r], x[0], qt + r);                                                         \
                    a1[r] = dot_bf16(a1[r], x[1], qt + r);                                                         \
                }                                                                                                  \
            }                                                                                                      \
        else                                                                                                       \
            for (int d = 0; d < D; d += 2, qt += 2 * R) {                                                          \
                vf x[4];                                                                                           \
                KEYS_(kt, d, x);                                                                                   \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                             \
                    a0[r] = fmadd(splat(qt[r]), x[0], a0[r]);                                                      \
                    a1[r] = fmadd(splat(qt[r]), x[1], a1[r]);                                                      \
                }                                                                                                  \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                             \
                    a0[r] = fmadd(splat(qt[R + r]), x[2], a0[r]);                                                  \
                    a1[r] = fmadd(splat(qt[R + r]), x[3], a1[r]);                                                  \
                }                                                                                                  \
            }                                                                                                      \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                     \
            store_f32(rh[r].s + at, a0[r] * scale);                                                                \
            store_f32(rh[r].s + at + W, a1[r] * scale);                                                            \
        }                                                                                                          \
    }                                                                                                              \
                                                                                                                   \
    /* One value row (CV vectors from v) into R accumulators acc[r * CV + c], weighted by pr[r][j]; only = 1:      \
       every pair, else only those whose slot range [ra[r], rb[r]) holds j. */                                     \
    static inline __attribute__((always_inline)) void step_##NAME(const int R, const int CV, vf *acc, const T_ *v, \
                                                                  const float **pr, const long *ra,                \
                                                                  const long *rb, long j, int only) {              \
        vf x[4];                                                                                                   \
        ROW_(v, x, CV);                                                                                            \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) if (only || (j >= ra[r] && j < rb[r]))                \
            _Pragma("GCC unroll 16") for (int c = 0; c < CV; c++)                                                  \
                acc[r * CV + c] = fmadd(splat(pr[r][j]), x[c], acc[r * CV + c]);                                   \
    }                                                                                                              \
                                                                                                                   \
    /* Columns col .. col + 16 CV of sum_j p_j v_j for R pairs: their run slots in slot order (the slots every     \
       pair attends without a test), then each pair's tail slots in order. */                                      \
    static inline __attribute__((always_inline)) void values_##NAME(const int R, const int CV, const T_ *v,        \
                                                                    long stride, rowhead *rh, int col) {           \
        vf acc[MAX_RV * 4];                                                                                        \
        const float *pr[MAX_RV]; /* pr[r][j]: pair r's weight of slot j */                                         \
        long ra[MAX_RV], rb[MAX_RV], lo = 1L << 62, hi = 0, all0 = 0, all1 = 1L << 62;                             \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                     \
            _Pragma("GCC unroll 16") for (int c = 0; c < CV; c++) acc[r * CV + c] = (vf){0};                       \
            ra[r] = rh[r].a, rb[r] = rh[r].b, pr[r] = rh[r].p - rh[r].a;                                           \
            if (ra[r] < rb[r]) {                                                                                   \
                lo = ra[r] < lo ? ra[r] : lo, hi = rb[r] > hi ? rb[r] : hi;                                        \
                all0 = ra[r] > all0 ? ra[r] : all0, all1 = rb[r] < all1 ? rb[r] : all1;                            \
            } else                                                                                                 \
                all0 = all1 = 0; /* a pair without run slots: test every slot */                                   \
        }                                                                                                          \
        if (all0 >= all1)                                                                                          \
            all0 = all1 = hi;                                                                                      \
        v += col;                                                                                                  \
        long j = lo;                                                                                               \
        for (; j < all0; j++)                                                                                      \
            step_##NAME(R, CV, acc, v + j * stride, pr, ra, rb, j, 0);                                             \
        for (; j < all1; j++) {                                                                                    \
            for (int c = 0; c < CV * W * (int)sizeof(T_); c += 64) /* 16 slots ahead: cut memory latency */        \
                __builtin_prefetch((const char *)(v + (j + 16) * stride) + c);                                     \
            step_##NAME(R, CV, acc, v + j * stride, pr, ra, rb, j, 1);                                             \
        }                                                                                                          \
        for (; j < hi; j++)                                                                                        \
            step_##NAME(R, CV, acc, v + j * stride, pr, ra, rb, j, 0);                                             \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                     \
            const float *p = rh[r].p + (rb[r] - ra[r]);                                                            \
            for (long i = 0; i < rh[r].ntail; i++) {                                                               \
                vf x[4];                                                                                           \
                ROW_(v + rh[r].tail[i] * stride, x, CV);                                                           \
                _Pragma("GCC unroll 16") for (int c = 0; c < CV; c++)                                              \
                    acc[r * CV + c] = fmadd(splat(p[i]), x[c], acc[r * CV + c]);                                   \
            }                                                                                                      \
            ORDER_ROW(ORDER_, acc + r * CV, CV);                                                                   \
            _Pragma("GCC unroll 16") for (int c = 0; c < CV; c++)                                                  \
                store_f32(rh[r].part + 2 + col + c * W, acc[r * CV + c]);                                          \
        }                                                                                                          \
    }
#else
/* AVX2 (no AVX-512): the same inner loops in 8-lane registers. GCC has no register for a 16-float vector without
   AVX-512, so the vector-extension loops above kept every accumulator on the stack and moved each fused
   multiply-add's halves through general registers (perf: a T = 9 SmolLM2 verification spent 39% of its time in
   attention). Per key and per output column these are the same operations in the same order (a score: one chain of
   fused multiply-adds over d, then times scale; an output column: one chain over the keys in key order, run slots
   then tail slots), so results are those of the 16-lane loops; bf16 is widened in element order (no pairs). */
static inline __m256 ld8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#define LD8(p) _Generic((p), const float *: ld8_f32, const uint16_t *: ld8_bf16)(p)
/* Dim d + e (d even, e = 0 or 1) of a key tile's slots l .. l + 7 (see tile_at): bf16 pairs split as pair_bf16 */
static inline __m256 key8_f32(const float *kt, int d, int e, int l) { return _mm256_loadu_ps(kt + (d + e) * 32 + l); }
static inline __m256 key8_bf16(const uint16_t *kt, int d, int e, int l) {
    __m256i u = _mm256_loadu_si256((const __m256i *)(kt + d * 32 + 2 * l));
    return _mm256_castsi256_ps(e ? _mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)) : _mm256_slli_epi32(u, 16));
}
#define KEY8(kt, d, e, l) _Generic((kt), const float *: key8_f32, const uint16_t *: key8_bf16)(kt, d, e, l)
#define ATTEND_HOT(NAME, T_, KEYS_, ORDER_, ROW_)                                                                  \
    /* 32 scores (one key tile, see tile_at) for R queries qt [D][R] -> s[r][at .. at + 32) */                     \
    static inline __attribute__((always_inline)) void scores_##NAME(const int R, const float *qt, const T_ *kt,    \
                                                                    int D, float scale, rowhead *rh, long at) {    \
        const T_ *kt0 = kt;                                                                                        \
        const float *qt0 = qt;                                                                                     \
        /* vectors of 8 keys a pass: 1-3 pairs (T = 1 with 3 query heads a KV head) take the whole tile, so their  \
           12 FMA chains (not 6) hide the FMA latency; 4-6 pairs have 8-12 with SCORES_NK = 2 */                    \
        const int NK = R <= 3 ? 4 : SCORES_NK;                                                                     \
        for (int h0 = 0; h0 < 4; h0 += NK) {                                                                       \
            __m256 a[MAX_R][4];                                                                                    \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                   \
                _Pragma("GCC unroll 4") for (int c = 0; c < NK; c++) a[r][c] = _mm256_setzero_ps();                \
            qt = qt0;                                                                                              \
            for (int d = 0; d < D; d += 2)                                                                         \
                for (int e = 0; e < 2; e++, qt += R) { /* dim d, then d + 1 */                                     \
                    if (R <= 3) { /* each query element broadcast once, the tile's vectors one at a time: 16       \
                                     registers */                                                                  \
                        __m256 qv[3];                                                                              \
                        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) qv[r] = _mm256_broadcast_ss(qt + r);  \
                        _Pragma("GCC unroll 4") for (int c = 0; c < NK; c++) {                                     \
                            __m256 x = KEY8(kt0, d, e, 8 * (h0 + c));                                              \
                            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                   \
                                a[r][c] = _mm256_fmadd_ps(qv[r], x, a[r][c]);                                      \
                        }                                                                                          \
                        continue;                                                                                  \
                    }                                                                                              \
                    __m256 x[4];                                                                                   \
                    _Pragma("GCC unroll 4") for (int c = 0; c < NK; c++) x[c] = KEY8(kt0, d, e, 8 * (h0 + c));     \
                    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                         \
                        __m256 qv = _mm256_broadcast_ss(qt + r);                                                   \
                        _Pragma("GCC unroll 4") for (int c = 0; c < NK; c++)                                       \
                            a[r][c] = _mm256_fmadd_ps(qv, x[c], a[r][c]);                                          \
                    }                                                                                              \
                }                                                                                                  \
            const __m256 sc = _mm256_set1_ps(scale);                                                               \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                   \
                _Pragma("GCC unroll 4") for (int c = 0; c < NK; c++)                                               \
                    _mm256_storeu_ps(rh[r].s + at + 8 * (h0 + c), _mm256_mul_ps(a[r][c], sc));                     \
        }                                                                                                          \
    }                                                                                                              \
                                                                                                                   \
    /* One value row's 32 columns from v into R pairs' accumulators acc[r][0..4), weighted by pr[r][j]; only = 1:  \
       every pair, else only those whose slot range [ra[r], rb[r]) holds j. */                                     \
    static inline __attribute__((always_inline)) void step_##NAME(const int R, const int NV, __m256 (*acc)[4],     \
                                                                  const T_ *v, const float **pr, const long *ra,   \
                                                                  const long *rb, long j, int only) {              \
        if (R <= 3) { /* as the scores': each weight broadcast once, the row's NV = 4 vectors one at a time */    \
            __m256 p[3];                                                                                           \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) p[r] = _mm256_broadcast_ss(pr[r] + j);            \
            _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++) {                                                 \
                __m256 x = LD8(v + 8 * c);                                                                         \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) if (only || (j >= ra[r] && j < rb[r]))        \
                    acc[r][c] = _mm256_fmadd_ps(p[r], x, acc[r][c]);                                               \
            }                                                                                                      \
            return;                                                                                                \
        }                                                                                                          \
        __m256 x[4];                                                                                               \
        _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++) x[c] = LD8(v + 8 * c);                                \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) if (only || (j >= ra[r] && j < rb[r])) {              \
            __m256 p = _mm256_broadcast_ss(pr[r] + j);                                                             \
            _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++) acc[r][c] = _mm256_fmadd_ps(p, x[c], acc[r][c]);  \
        }                                                                                                          \
    }                                                                                                              \
                                                                                                                   \
    /* Columns col .. col + 16 CV of sum_j p_j v_j for R pairs, 32 columns (NV = 4 registers) a pass: their run     \
       slots in slot order (the slots every pair attends without a test), then each pair's tail slots in order. */ \
    static inline __attribute__((always_inline)) void values_##NAME(const int R, const int CV, const T_ *v,        \
                                                                    long stride, rowhead *rh, int col) {           \
        const int NV = CV == 1 ? 2 : R <= 3 ? 4 : VALUES_NV; /* 1-3 pairs: 12 chains, as the scores' */          \
        const float *pr[MAX_RV];                                                                                   \
        long ra[MAX_RV], rb[MAX_RV], lo = 1L << 62, hi = 0, all0 = 0, all1 = 1L << 62;                             \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                     \
            ra[r] = rh[r].a, rb[r] = rh[r].b, pr[r] = rh[r].p - rh[r].a;                                           \
            if (ra[r] < rb[r]) {                                                                                   \
                lo = ra[r] < lo ? ra[r] : lo, hi = rb[r] > hi ? rb[r] : hi;                                        \
                all0 = ra[r] > all0 ? ra[r] : all0, all1 = rb[r] < all1 ? rb[r] : all1;                            \
            } else                                                                                                 \
                all0 = all1 = 0;                                                                                   \
        }                                                                                                          \
        if (all0 >= all1)                                                                                          \
            all0 = all1 = hi;                                                                                      \
        for (int c0 = 0; c0 < 16 * CV; c0 += 8 * NV) {                                                             \
            const T_ *vc = v + col + c0;                                                                           \
            __m256 acc[MAX_RV][4];                                                                                 \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                                   \
                _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++) acc[r][c] = _mm256_setzero_ps();              \
            long j = lo;                                                                                           \
            for (; j < all0; j++)                                                                                  \
                step_##NAME(R, NV, acc, vc + j * stride, pr, ra, rb, j, 0);                                        \
            for (; j < all1; j++) {                                                                                \
                __builtin_prefetch((const char *)(vc + (j + 16) * stride)); /* 16 slots ahead */                  \
                step_##NAME(R, NV, acc, vc + j * stride, pr, ra, rb, j, 1);                                        \
            }                                                                                                      \
            for (; j < hi; j++)                                                                                    \
                step_##NAME(R, NV, acc, vc + j * stride, pr, ra, rb, j, 0);                                        \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                                 \
                const float *p = rh[r].p + (rb[r] - ra[r]);                                                        \
                for (long i = 0; i < rh[r].ntail; i++) {                                                           \
                    const T_ *x = vc + rh[r].tail[i] * stride;                                                     \
                    __m256 w = _mm256_broadcast_ss(p + i);                                                         \
                    _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++)                                           \
                        acc[r][c] = _mm256_fmadd_ps(w, LD8(x + 8 * c), acc[r][c]);                                 \
                }                                                                                                  \
                _Pragma("GCC unroll 4") for (int c = 0; c < NV; c++)                                               \
                    _mm256_storeu_ps(rh[r].part + 2 + col + c0 + 8 * c, acc[r][c]);                                \
            }                                                                                                      \
        }                                                                                                          \
    }
#endif

/* With AVX-512 BF16, a bf16 cache's outputs sum_j p_j v_j take two keys a VDPBF16PS: in each lane, one column's
   values of slots j, j + 1 (a bf16 pair) times the weights p_j, p_j+1 rounded to bf16, both products added into
   the f32 accumulator. As FlashAttention-2 (Dao 2023) casts P to the inputs' type before its P V product, the
   softmax's sum staying in f32 from the unrounded weights; half the instructions of a fused multiply-add per key
   and column (the keys' scores already take pairs of dims, tile_at): SmolLM2's forwards at 800 cached 1.03x / 1.05x
   at T = 4 / 9, batch 8 1.02x, Gemma-3-270M's 1.02x (docs/results/pv-pairs-1207h.txt). Columns come 64 at a time
   (Dv a multiple of 64; narrower heads keep the f32 loop).
   Keys are paired by their place in the run of their decode step (v0 + k for the part's key k: a chain's slot
   itself; a tree path's tail slot, the slot it is compacted into on acceptance): pair m holds places 2m and 2m + 1,
   a place outside the part weighs 0, and the pairs are added in order, so a row's arithmetic is the same whether it
   runs alone, beside other rows, or as a tree node before its path is compacted: the batch invariance above. */
#if BF16DOT
#define PV_PAIRS 1
/* whether a kernel of storage type T_ with Dv-wide values takes this path (weight_pairs, then values_pairs_any) */
#define PAIRS_ON(T_, Dv) (sizeof(T_) == 2 && (Dv) % 64 == 0)
/* weights: exp(s - max) (the part's n keys at p, zero past them to a multiple of 16) -> rh->w in bf16 (round to
   nearest even), word m - (v0 >> 1) = places 2m (low half), 2m + 1 (high half) */
static void weight_pairs(rowhead *rh, long n) {
    uint16_t *wb = (uint16_t *)rh->w;
    long off = rh->v0 & 1, full = (n + W - 1) / W * W;
    wb[0] = 0;
    for (long k = 0; k < full; k += W)
        _mm256_storeu_si256((__m256i *)(wb + off + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(rh->p + k)));
    wb[off + full] = wb[off + full + 1] = 0;
}

/* 64 columns of the values of slots s0, s1 (rows r0, r1) as VDPBF16PS operands: x[c] lane 4 L + i holds the pair
   of column 8 L + i (c even) or 8 L + 4 + i (c odd), plus 32 for c >= 2 (an unpack works within 128-bit lanes);
   order_pairs puts the sums' columns back in order. */
static inline void value_pairs(const uint16_t *r0, const uint16_t *r1, __m512i *x) {
    __m512i a0 = _mm512_loadu_si512(r0), a1 = _mm512_loadu_si512(r0 + 32);
    __m512i b0 = _mm512_loadu_si512(r1), b1 = _mm512_loadu_si512(r1 + 32);
    x[0] = _mm512_unpacklo_epi16(a0, b0), x[1] = _mm512_unpackhi_epi16(a0, b0);
    x[2] = _mm512_unpacklo_epi16(a1, b1), x[3] = _mm512_unpackhi_epi16(a1, b1);
}

static inline void order_pairs(vf *a, vf *b) {
    const vi m0 = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    const vi m1 = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    vf x = __builtin_shuffle(*a, *b, m0), y = __builtin_shuffle(*a, *b, m1);
    *a = x, *b = y;
}

/* One pair of value rows into the accumulators of the R pairs (row, head) whose run pairs [ma, mb) hold m (only:
   all of them). */
static inline __attribute__((always_inline)) void step_pairs(const int R, __m512 *acc, const uint16_t *v,
                                                             long stride, const uint32_t **wr, const long *ma,
                                                             const long *mb, long m, int only) {
    __m512i x[4];
    value_pairs(v + 2 * m * stride, v + (2 * m + 1) * stride, x);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) if (only || (m >= ma[r] && m < mb[r])) {
        __m512bh w = (__m512bh)_mm512_set1_epi32((int)wr[r][m]);
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
            acc[r * 4 + c] = _mm512_dpbf16_ps(acc[r * 4 + c], (__m512bh)x[c], w);
    }
}

/* Columns col .. col + 63 of sum_j p_j v_j for R pairs (weight_pairs done): the pairs of places every run covers
   (each pair of value rows loaded once for all of them), then each one's tail: the pairs from its run's last
   (unless whole) to its last key, a place's slot being the run's or the tail's. */
static inline __attribute__((always_inline)) void values_pairs(const int R, const uint16_t *v, long stride,
                                                               rowhead *rh, int col) {
    __m512 acc[MAX_RV * 4];
    const uint32_t *wr[MAX_RV]; /* wr[r][m]: pair r's weights of places 2m, 2m + 1 */
    long ma[MAX_RV], mb[MAX_RV], lo = 1L << 62, hi = 0, all0 = 0, all1 = 1L << 62;
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[r * 4 + c] = _mm512_setzero_ps();
        wr[r] = rh[r].w - (rh[r].v0 >> 1);
        ma[r] = rh[r].a >> 1, mb[r] = rh[r].a < rh[r].b ? (rh[r].ntail ? rh[r].b >> 1 : (rh[r].b + 1) >> 1) : 0;
        if (ma[r] < mb[r]) {
            lo = ma[r] < lo ? ma[r] : lo, hi = mb[r] > hi ? mb[r] : hi;
            all0 = ma[r] > all0 ? ma[r] : all0, all1 = mb[r] < all1 ? mb[r] : all1;
        } else
            ma[r] = mb[r] = 0, all0 = all1 = 0;
    }
    if (all0 >= all1)
        all0 = all1 = hi;
    v += col;
    long m = lo;
    for (; m < all0; m++)
        step_pairs(R, acc, v, stride, wr, ma, mb, m, 0);
    for (; m < all1; m++) {
        for (int c = 0; c < 128; c += 64) { /* 16 slots ahead: cut memory latency */
            __builtin_prefetch((const char *)(v + (2 * m + 16) * stride) + c);
            __builtin_prefetch((const char *)(v + (2 * m + 17) * stride) + c);
        }
        step_pairs(R, acc, v, stride, wr, ma, mb, m, 1);
    }
    for (; m < hi; m++)
        step_pairs(R, acc, v, stride, wr, ma, mb, m, 0);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        const long a = rh[r].a, run = rh[r].b - a, v0 = rh[r].v0, vb = v0 + run, end = vb + rh[r].ntail;
        const int64_t *tail = rh[r].tail;
        for (long at = rh[r].ntail ? (run ? rh[r].b & ~1L : v0 & ~1L) : end; at < end; at += 2) { /* places */
            long p0 = at < v0 ? at + 1 : at, p1 = at + 1 < end ? at + 1 : p0; /* a place outside weighs 0 */
            long s0 = p0 < vb ? a + p0 - v0 : tail[p0 - vb], s1 = p1 < vb ? a + p1 - v0 : tail[p1 - vb];
            __m512i x[4];
            value_pairs(v + s0 * stride, v + s1 * stride, x);
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)wr[r][at >> 1]);
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                acc[r * 4 + c] = _mm512_dpbf16_ps(acc[r * 4 + c], (__m512bh)x[c], w);
        }
        vf o[4];
        memcpy(o, acc + r * 4, sizeof o);
        order_pairs(o, o + 1), order_pairs(o + 2, o + 3);
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) store_f32(rh[r].part + 2 + col + c * W, o[c]);
    }
}

static void values_pairs_any(int R, const uint16_t *v, long stride, rowhead *rh, int D) {
    for (int col = 0; col < D; col += 64)
        switch (R) {
        case 1: values_pairs(1, v, stride, rh, col); break;
        case 2: values_pairs(2, v, stride, rh, col); break;
        case 3: values_pairs(3, v, stride, rh, col); break;
        case 4: values_pairs(4, v, stride, rh, col); break;
        case 5: values_pairs(5, v, stride, rh, col); break;
        default: values_pairs(MAX_RV, v, stride, rh, col); break;
        }
}
#else
#define PV_PAIRS 0
#define PAIRS_ON(T_, Dv) 0
static void weight_pairs(rowhead *rh, long n) { (void)rh, (void)n; }
static void values_pairs_any(int R, const uint16_t *v, long stride, rowhead *rh, int D) {
    (void)R, (void)v, (void)stride, (void)rh, (void)D;
}
#endif

/* The kernel, instantiated for f32 and bf16 storage (T_ the element type, ST_ its vector store,
   PAIR_ / ORDER_ / ROW_ as above); its inner loops for a constant number R of (row, head) pairs that share a KV
   head and so each key tile and value row loaded (one instantiation for each R, dispatched at run time). */
#define ATTEND_KERNEL(NAME, T_, ST_, KEYS_, ORDER_, ROW_)                                                          \
    ATTEND_HOT(NAME, T_, KEYS_, ORDER_, ROW_)                                                                      \
                                                                                                                   \
    /* The instantiations for each R, dispatched at run time */                                                    \
    static void scores_any_##NAME(int R, const float *qt, const T_ *kt, int D, float scale, rowhead *rh,           \
                                  long at) {                                                                       \
        switch (R) {                                                                                               \
        case 1: if (1 <= MAX_R) scores_##NAME(1, qt, kt, D, scale, rh, at); break;                                 \
        case 2: if (2 <= MAX_R) scores_##NAME(2, qt, kt, D, scale, rh, at); break;                                 \
        case 3: if (3 <= MAX_R) scores_##NAME(3, qt, kt, D, scale, rh, at); break;                                 \
        case 4: if (4 <= MAX_R) scores_##NAME(4, qt, kt, D, scale, rh, at); break;                                 \
        case 5: if (5 <= MAX_R) scores_##NAME(5, qt, kt, D, scale, rh, at); break;                                 \
        case 6: if (6 <= MAX_R) scores_##NAME(6, qt, kt, D, scale, rh, at); break;                                 \
        case 7: if (7 <= MAX_R) scores_##NAME(7, qt, kt, D, scale, rh, at); break;                                 \
        case 8: if (8 <= MAX_R) scores_##NAME(8, qt, kt, D, scale, rh, at); break;                                 \
        case 9: if (9 <= MAX_R) scores_##NAME(9, qt, kt, D, scale, rh, at); break;                                 \
        case 10: if (10 <= MAX_R) scores_##NAME(10, qt, kt, D, scale, rh, at); break;                              \
        case 11: if (11 <= MAX_R) scores_##NAME(11, qt, kt, D, scale, rh, at); break;                              \
        default: scores_##NAME(MAX_R, qt, kt, D, scale, rh, at); break;                                            \
        }                                                                                                          \
    }                                                                                                              \
    static void values_cv_##NAME(const int CV, int R, const T_ *v, long stride, rowhead *rh, int col) {            \
        switch (R) {                                                                                               \
        case 1: if (1 <= MAX_RV) values_##NAME(1, CV, v, stride, rh, col); break;                                  \
        case 2: if (2 <= MAX_RV) values_##NAME(2, CV, v, stride, rh, col); break;                                  \
        case 3: if (3 <= MAX_RV) values_##NAME(3, CV, v, stride, rh, col); break;                                  \
        case 4: if (4 <= MAX_RV) values_##NAME(4, CV, v, stride, rh, col); break;                                  \
        case 5: if (5 <= MAX_RV) values_##NAME(5, CV, v, stride, rh, col); break;                                  \
        default: values_##NAME(MAX_RV, CV, v, stride, rh, col); break;                                             \
        }                                                                                                          \
    }                                                                                                              \
    static void values_any_##NAME(int R, const T_ *v, long stride, rowhead *rh, int D) {                           \
        if (PAIRS_ON(T_, D))                                                                                       \
            values_pairs_any(R, (const uint16_t *)v, stride, rh, D);                                               \
        else if (D == 16)                                                                                          \
            values_cv_##NAME(1, R, v, stride, rh, 0);                                                              \
        else if (D == 32)                                                                                          \
            values_cv_##NAME(2, R, v, stride, rh, 0);                                                              \
        else                                                                                                       \
            for (int col = 0; col < D; col += 4 * W)                                                               \
                values_cv_##NAME(4, R, v, stride, rh, col);                                                        \
    }                                                                                                              \
                                                                                                                   \
    /* One unit: its nr pairs rh (each query, keys and part set) over one KV head, whose keys are in the tiles kth \
       (D wide) and whose value of slot j is vals[j * stride ..] (Dv wide); scratch qt: MAX_R * D floats */        \
    static void unit_##NAME(rowhead *rh, int nr, const T_ *vals, long stride, const T_ *kth, int D, int Dv,        \
                            float scale, long base, float *qt) {                                                   \
        /* scores, MAX_R pairs at a time, each tile that holds one of their slots loaded once for all of them */   \
        for (int r0 = 0; r0 < nr; r0 += MAX_R) {                                                                   \
            int R = nr - r0 < MAX_R ? nr - r0 : MAX_R;                                                             \
            long first = 1L << 62, last = -1;                                                                      \
            for (int r = r0; r < r0 + R; r++) {                                                                    \
                if (rh[r].a < rh[r].b)                                                                             \
                    first = rh[r].a < first ? rh[r].a : first, last = rh[r].b - 1 > last ? rh[r].b - 1 : last;     \
                for (long i = 0; i < rh[r].ntail; i++)                                                             \
                    first = rh[r].tail[i] < first ? rh[r].tail[i] : first,                                         \
                    last = rh[r].tail[i] > last ? rh[r].tail[i] : last;                                            \
                if (BF16DOT && sizeof(T_) == 2) /* bf16 pairs, transposed: qt[d / 2][r] */                         \
                    for (int d = 0; d < D; d += 2)                                                                 \
                        memcpy(qt + d / 2 * R + r - r0, (const T_ *)rh[r].q + d, 4);                               \
                else /* the queries in f32, transposed: qt[d][r] */                                                \
                    for (int d = 0; d < D; d++)                                                                    \
                        qt[d * R + r - r0] = ELEM((const T_ *)rh[r].q + d);                                        \
            }                                                                                                      \
            /* the key tiles: no prefetch, the hardware's streams them (a burst of the next tile's 64 lines            \
               stalled on the L1's miss buffers: without it batch 8 at 600-1000 cached 1.04-1.05x, chains 1.00-1.04x,  \
               docs/results/tile-prefetch-1207h.txt) */                                                                \
            for (long x = first / BLOCK; x <= last / BLOCK; x++) {                                                 \
                if (r0 == 0) /* the next tile's value rows, into L2 for the outputs: memory bound at T = 1 */          \
                    for (long j = (x + 1) * BLOCK; j < (x + 2) * BLOCK; j++)                                       \
                        for (int c = 0; c < Dv * (int)sizeof(T_); c += 64)                                         \
                            __builtin_prefetch((const char *)(vals + j * stride) + c, 0, 2);                       \
                scores_any_##NAME(R, qt, kth + x * D * BLOCK, D, scale, rh + r0, x * BLOCK - base);                \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < nr; r++) {                                                                             \
            softmax_part(rh + r, base);                                                                            \
            if (PAIRS_ON(T_, Dv))                                                                                  \
                weight_pairs(rh + r, rh[r].b - rh[r].a + rh[r].ntail);                                             \
        }                                                                                                          \
        /* outputs, MAX_RV pairs at a time, each value row loaded once for all of them */                          \
        for (int r0 = 0; r0 < nr; r0 += MAX_RV)                                                                    \
            values_any_##NAME(nr - r0 < MAX_RV ? nr - r0 : MAX_RV, vals, stride, rh + r0, Dv);                     \
    }                                                                                                              \
                                                                                                                   \
    /* One head's output from its parts: o = acc / sum for one part; for two, rescaled to their common max. */     \
    static inline void merge_##NAME(const float *p0, const float *p1, const int D, T_ *o) {                        \
        if (!p1) {                                                                                                 \
            float inv = 1.0f / p0[1];                                                                              \
            for (int c = 0; c < D / W; c++)                                                                        \
                ST_(o + c * W, load_f32(p0 + 2 + c * W) * inv);                                                    \
            return;                                                                                                \
        }                                                                                                          \
        float m = p0[0] > p1[0] ? p0[0] : p1[0];                                                                   \
        vf e = exp_vf((vf){p0[0] - m, p1[0] - m});                                                                 \
        float inv = 1.0f / (p0[1] * e[0] + p1[1] * e[1]);                                                          \
        for (int c = 0; c < D / W; c++)                                                                            \
            ST_(o + c * W, (load_f32(p0 + 2 + c * W) * e[0] + load_f32(p1 + 2 + c * W) * e[1]) * inv);             \
    }

ATTEND_KERNEL(attend_f32, float, store_f32, keys_f32, order_f32, row_f32)
ATTEND_KERNEL(attend_bf16, uint16_t, store_bf16, keys_bf16, order_bf16, row_bf16)

/* Scratch that lives as long as its thread (OpenMP's pool threads live as long as the process): grown, never
   shrunk, so a call allocates nothing once warm. */
static void *grow(void **buf, size_t *size, size_t need) {
    if (need > *size) {
        free(*buf);
        *buf = aligned_alloc(64, (need + 63) / 64 * 64);
        *size = *buf ? need : 0;
    }
    return *buf;
}
static __thread void *call_buf, *unit_buf;
static __thread size_t call_size, unit_size;

/* Row t's keys: n in all, split at cut (n when it is not split); the first run of them are the consecutive slots
   lo .. lo + run - 1 (the tails that continue hi .. are counted in: a chain's row is one run), the rest the slots
   tail[0 .. n - run). */
typedef struct {
    long lo, n, cut, run;
    const int64_t *tail;
} rowinfo;

/* Row ri's part half (0: keys 0 .. cut - 1, 1: cut .. n - 1) as a rowhead's a, b, ntail, tail; 0 if it has none. */
static int row_part(const rowinfo *ri, int half, rowhead *rh) {
    if (half && ri->cut == ri->n)
        return 0;
    long k0 = half ? ri->cut : 0, k1 = half ? ri->n : ri->cut, run = ri->run;
    rh->a = ri->lo + (k0 < run ? k0 : run);
    rh->b = ri->lo + (k1 < run ? k1 : run);
    rh->ntail = k1 > run ? k1 - (k0 > run ? k0 : run) : 0;
    rh->tail = ri->tail + (k0 > run ? k0 - run : 0);
    rh->v0 = ri->lo + k0;
    return 1;
}

/* One unit: the heads of KV head kvh, for rows t0 .. t1 - 1 (those that have part half) -> their parts. Returns -1
   when memory runs out. */
static int run_unit(const void *q, long q_stride, const void *kv, const void *kt, long tiles, int H, int Hkv, int D,
                    int Dv, int latent, const rowinfo *rows, int t0, int t1, int kvh, int half, float scale,
                    float *parts, int bf16) {
    int group = H / Hkv, nr = 0;
    long first = 1L << 62, last = -1, longest = 0; /* the slots the pairs' keys span, the most keys of a pair */
    for (int t = t0; t < t1; t++) {
        rowhead x;
        if (!row_part(rows + t, half, &x))
            continue;
        if (x.a < x.b)
            first = x.a < first ? x.a : first, last = x.b - 1 > last ? x.b - 1 : last;
        for (long i = 0; i < x.ntail; i++)
            first = x.tail[i] < first ? x.tail[i] : first, last = x.tail[i] > last ? x.tail[i] : last;
        longest = x.b - x.a + x.ntail > longest ? x.b - x.a + x.ntail : longest;
        nr += group;
    }
    /* per pair: scores by slot over [base, base + span) (whole tiles, and room for the padding of exp), then room
       for its scores in key order when it has tail slots */
    long base = first / BLOCK * BLOCK, span = (last / BLOCK + 1) * BLOCK - base + W;
    long plen = (longest + W - 1) / W * W;
    size_t head = (sizeof(rowhead) * nr + 63) / 64 * 64;
    long wlen = plen / 2 + W; /* weight_pairs' words */
    char *buf = grow(&unit_buf, &unit_size, head + sizeof(float) * (MAX_R * D + nr * (span + plen + wlen)));
    if (!buf)
        return -1;
    rowhead *rh = (rowhead *)buf;
    float *qt = (float *)(buf + head), *mem = qt + MAX_R * D;
    size_t esize = bf16 ? 2 : 4;
    int r = 0;
    for (int t = t0; t < t1; t++) {
        rowhead x;
        if (!row_part(rows + t, half, &x))
            continue;
        for (int h = kvh * group; h < (kvh + 1) * group; h++, r++) {
            rh[r] = x;
            rh[r].q = (const char *)q + (t * q_stride + (long)h * D) * esize;
            rh[r].s = mem + (long)r * (span + plen);
            rh[r].p = x.ntail ? rh[r].s + span : rh[r].s + (x.a - base);
            rh[r].part = parts + ((long)(t * H + h) * 2 + half) * (Dv + 2);
            rh[r].w = (uint32_t *)(mem + (long)nr * (span + plen) + (long)r * wlen);
        }
    }
    /* a slot's value: in head kvh's rows of the values [Hkv, S, D] (one stream per head: with the heads of a slot
       side by side, [S, Hkv, D], a head's rows were 384 bytes apart and a decode step's attention at 1500 cached
       slots took 1.24x as long, docs/results/values-head-major-1206.txt; the keys are only in the tiles), or
       (latent) the first Dv elements of its one vector */
    long voff = latent ? 0 : (long)kvh * tiles * BLOCK * D, stride = D;
    if (bf16)
        unit_attend_bf16(rh, nr, (const uint16_t *)kv + voff, stride, (const uint16_t *)kt + kvh * tiles * D * BLOCK,
                         D, Dv, scale, base, qt);
    else
        unit_attend_f32(rh, nr, (const float *)kv + voff, stride, (const float *)kt + kvh * tiles * D * BLOCK, D,
                        Dv, scale, base, qt);
    return 0;
}

/* q: T rows of H heads of D (row stride q_stride elements, head stride D); kv: one layer's values [Hkv, S, D], head
   by head, S = 32 x tiles; kt: its keys, in tiles [Hkv, tiles, ...] (see tile_at; their only copy: rope_store /
   store_keys write them).
   Row t attends the slots lo[t] .. hi[t] - 1, then tails[toff[t] .. toff[t + 1]) (at least one slot in all);
   out: [T, H, D] contiguous. D must be 16, 32, 64, 128 or 256. Returns 0, -1 when memory runs out, -2 for an
   unsupported D. (specdec_attend_latent: the same for multi-head latent attention.)

   The work is cut in units (a KV head, a half, a group of rows), spread over OpenMP threads (the runtime PyTorch
   loaded: one thread pool); the unit that completes a (KV head, group of rows) last merges its pairs' halves. A
   unit is computed whole by one thread, and a pair's arithmetic does not depend on which unit holds it, so
   threading changes no result. */
static int attend(const void *q, long q_stride, const void *kv, const void *kt, long tiles, int H, int Hkv, int D,
                  int Dv, int latent, int T, const int64_t *lo, const int64_t *hi, const int64_t *tails,
                  const int64_t *toff, float scale, void *out, int bf16) {
    int group = H / Hkv, halves = 1, threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    /* rows in groups: never rows of two sequences in one (their slots are a pool slot apart, and a unit's scores
       span every tile between its rows' keys); a single sequence's rows in ng groups, so that the units are a
       multiple of the threads (balanced) when they are few */
    size_t nparts = (size_t)T * H * 2 * (Dv + 2);
    float *parts = grow(&call_buf, &call_size,
                        sizeof(float) * nparts + sizeof(rowinfo) * T + sizeof(int) * (Hkv + 1) * (T + 1));
    if (!parts)
        return -1;
    rowinfo *rows = (rowinfo *)(parts + nparts);
    int *gb = (int *)(rows + T), ng = 0; /* group g holds rows gb[g] .. gb[g + 1] - 1 */
    gb[0] = 0;
    for (int t = 1; t < T; t++)
        if (hi[t] != hi[t - 1]) /* a new sequence: each one's rows share the end of their cached run */
            gb[++ng] = t;
    gb[++ng] = T;
    for (int t = 0; t < T; t++) {
        long np = hi[t] - lo[t], nt = toff[t + 1] - toff[t], n = np + nt, c = 0;
        const int64_t *tail = tails + toff[t];
        while (c < nt && tail[c] == hi[t] + c) /* tails that continue the run (a chain) join it */
            c++;
        rows[t] = (rowinfo){lo[t], n, n >= SPLIT ? n / 2 : n, np + c, tail + c};
        halves = n >= SPLIT ? 2 : halves;
    }
    if (ng == 1) {
        while (ng < T && (Hkv * halves * ng) % threads != 0 && Hkv * halves * ng < 2 * threads)
            ng++;
        for (int g = 0; g <= ng; g++)
            gb[g] = T * g / ng;
    }
    int units = Hkv * halves * ng, failed = 0, *done = gb + T + 1; /* units done per (KV head, group) */
    memset(done, 0, sizeof(int) * Hkv * ng);
#pragma omp parallel for schedule(static) if (units > 1 && threads > 1)                                            \
    num_threads(units < threads ? units : threads) reduction(| : failed)
    for (int u = 0; u < units; u++) {
        int kvh = u / (halves * ng), half = u / ng % halves, g = u % ng, t0 = gb[g], t1 = gb[g + 1];
#if UNIT_AHEAD
        if (u + 1 < units) { /* the next unit's first key tiles and value rows (UNIT_AHEAD), while this one runs */
            int nk = (u + 1) / (halves * ng), nh = (u + 1) / ng % halves, nt0 = gb[(u + 1) % ng];
            long first = rows[nt0].lo + (nh ? rows[nt0].cut : 0), esz = bf16 ? 2 : 4;
            const char *kp = (const char *)kt + ((long)nk * tiles + first / BLOCK) * D * BLOCK * esz;
            const char *vp = latent ? (const char *)kv + first * D * esz
                                    : (const char *)kv + ((long)nk * tiles * BLOCK + first) * D * esz;
            for (long c = 0; c < UNIT_AHEAD * D * BLOCK * esz; c += 64)
                __builtin_prefetch(kp + c, 0, 2);
            for (long c = 0; c < UNIT_AHEAD * BLOCK * Dv * esz; c += 64)
                __builtin_prefetch(vp + c, 0, 2);
        }
#endif
        if (failed ||
            run_unit(q, q_stride, kv, kt, tiles, H, Hkv, D, Dv, latent, rows, t0, t1, kvh, half, scale, parts,
                     bf16)) {
            failed = 1;
            continue;
        }
        if (__atomic_add_fetch(done + kvh * ng + g, 1, __ATOMIC_ACQ_REL) < halves)
            continue; /* the other half is still being computed */
        for (int t = t0; t < t1; t++)
            for (int h = kvh * group; h < (kvh + 1) * group; h++) {
                const float *p0 = parts + (long)(t * H + h) * 2 * (Dv + 2);
                const float *p1 = rows[t].cut < rows[t].n ? p0 + Dv + 2 : 0;
                if (bf16)
                    merge_attend_bf16(p0, p1, Dv, (uint16_t *)out + (long)(t * H + h) * Dv);
                else
                    merge_attend_f32(p0, p1, Dv, (float *)out + (long)(t * H + h) * Dv);
            }
    }
    return failed ? -1 : 0;
}

/* 1 where a bf16 cache's outputs take their values two keys a VDPBF16PS with bf16 weights (values_pairs), else 0 */
int specdec_attend_pairs(void) { return PV_PAIRS; }

int specdec_attend(const void *q, long q_stride, const void *kv, const void *kt, long tiles, int H, int Hkv, int D,
                   int T, const int64_t *lo, const int64_t *hi, const int64_t *tails, const int64_t *toff,
                   float scale, void *out, int bf16) {
    if (D != 16 && D != 32 && D != 64 && D != 128 && D != 256)
        return -2;
    return attend(q, q_stride, kv, kt, tiles, H, Hkv, D, D, 0, T, lo, hi, tails, toff, scale, out, bf16);
}

/* Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434), absorbed: all H query heads (D = kv_lora_rank +
   rope_dim wide, in latent space) attend one vector per slot, kv [S, 1, D] (tiles kt [1, tiles, ...]), which is
   each slot's key, and whose first Dv (= kv_lora_rank) elements are its value. out: [T, H, Dv]. One KV head of H
   query heads: every key tile and value row is loaded once for up to MAX_R / MAX_RV heads. D a multiple of 16,
   Dv 16, 32 or a multiple of 64, at most D. Returns as specdec_attend. */
int specdec_attend_latent(const void *q, long q_stride, const void *kv, const void *kt, long tiles, int H, int D,
                          int Dv, int T, const int64_t *lo, const int64_t *hi, const int64_t *tails,
                          const int64_t *toff, float scale, void *out, int bf16) {
    if (D % W || D > 1024 || Dv > D || (Dv != 16 && Dv != 32 && Dv % 64))
        return -2;
    return attend(q, q_stride, kv, kt, tiles, H, 1, D, Dv, 1, T, lo, hi, tails, toff, scale, out, bf16);
}

/* Copy keys [n_layers][end - start][Hkv][D] (the key of slot x at keys + layer * kv_layer + (x - start) * row:
   rows of a qkv projection, or a latent cache's own rows [S, 1, D]) into the tiles kt [Hkv, tiles, ...] (see
   tile_at), for n_layers layers (kv_layer / kt_layer: elements between layers); esize: bytes per element (2 or 4). */
#define STORE_KEYS(T_)                                                                                             \
    for (int layer = 0; layer < n_layers; layer++)                                                                 \
        for (long x = start; x < end; x++)                                                                         \
            for (int h = 0; h < Hkv; h++) {                                                                        \
                const T_ *src = (const T_ *)keys + layer * kv_layer + (x - start) * row + h * D;                   \
                T_ *dst = (T_ *)kt + layer * kt_layer + (h * tiles + x / BLOCK) * D * BLOCK;                       \
                for (int d = 0; d < D; d++)                                                                        \
                    dst[tile_at(d, x % BLOCK, sizeof(T_))] = src[d];                                               \
            }
void specdec_store_keys(const void *keys, void *kt, int n_layers, long kv_layer, long kt_layer, long tiles, int Hkv,
                        int D, long row, long start, long end, int esize) {
    if (esize == 2) {
        STORE_KEYS(uint16_t)
    } else {
        STORE_KEYS(float)
    }
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does (no NaN here) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#define ROPE_STORE(T_, LOAD, STORE)                                                                                \
    for (int t = 0; t < T; t++) {                                                                                  \
        T_ *row = (T_ *)qkv + (long)t * (H + 2 * Hkv) * D;                                                         \
        const float *c = cos + (long)t * D, *s = sin + (long)t * D;                                                \
        for (int h = 0; h < H + Hkv; h++) {                                                                        \
            T_ *x = row + (long)h * D;                                                                             \
            float f[256], y[256];                                                                                  \
            for (int d = 0; d < D; d++)                                                                            \
                f[d] = LOAD(x[d]);                                                                                 \
            for (int d = 0; d < D / 2; d++)                                                                        \
                y[d] = f[d] * c[d] + f[d + D / 2] * s[d];                                                          \
            for (int d = D / 2; d < D; d++)                                                                        \
                y[d] = f[d] * c[d] + f[d - D / 2] * s[d];                                                          \
            for (int d = 0; d < D; d++)                                                                            \
                x[d] = STORE(y[d]);                                                                                \
        }                                                                                                          \
        long slot = (long)slots[t];                                                                                \
        for (int h = 0; h < Hkv; h++) /* the value, head by head */                                                \
            memcpy((T_ *)kv + ((long)h * tiles * BLOCK + slot) * D, row + (long)(H + Hkv + h) * D, sizeof(T_) * D); \
        for (int h = 0; h < Hkv; h++) {                                                                            \
            T_ *dst = (T_ *)kt + ((long)h * tiles + slot / BLOCK) * D * BLOCK;                                     \
            for (int d = 0; d < D; d++)                                                                            \
                dst[tile_at(d, slot % BLOCK, sizeof(T_))] = row[(long)(H + h) * D + d];                            \
        }                                                                                                          \
    }
#define AS_IS(x) (x)

/* RoPE (Su et al. 2021) on the query and key heads of qkv [T, H + 2 Hkv, D], in place: x cos + rotate_half(x) sin,
   rotate_half being a roll by D / 2 with its sign folded into sin (cos, sin: f32 [T, D], the rows of the tables of
   models/transformer.py's Rope at the T positions); then row t's value stored at slot slots[t] of one layer's
   value cache kv [Hkv, S, D] (S = 32 x tiles; rows of several sequences go to their own slots), and its key in the
   key tiles kt [Hkv, tiles, ...] (see tile_at), the keys' only copy. One call
   instead of the handful of small PyTorch ops a decode step would spend on it per layer. Each row is computed on
   its own, so batch invariance is kept. esize: bytes per element (2: bf16, 4: f32). */
void specdec_rope_store(void *qkv, int T, int H, int Hkv, int D, const float *cos, const float *sin, void *kv,
                        void *kt, long tiles, const int64_t *slots, int esize) {
    if (esize == 2) {
        ROPE_STORE(uint16_t, bf16_to_f32, f32_to_bf16)
    } else {
        ROPE_STORE(float, AS_IS, AS_IS)
    }
}
