/* Batch-invariant attention for decode and verification steps (CPU, f32 or bf16 storage, f32 arithmetic).

   Each (query row, head) pair attends over its own cache slots, computed by the same instructions in the same order
   whatever the other rows are: row i of a verification forward over T tokens is bitwise the decode step that would
   compute that token alone. General attention kernels are not batch-invariant (they split and vectorize their
   reductions by the shape of the whole batch: "Defeating Nondeterminism in LLM Inference", He et al., Thinking
   Machines 2025); this one is, so speculative greedy output can never differ from plain greedy output, and a
   verification over T rows costs one call, not T.

   Per (row, head): s_j = scale * q . k_j, p = softmax(s) (max, then exp and sum), o = sum_j p_j v_j / sum_j p_j.
   - scores: keys are kept a second time in tiles of 32 slots, transposed (kt [Hkv, tiles, D, 32]: 4 KB read
     front to back per tile for D = 64, bf16), so 32 scores are computed together, each one chain of fused
     multiply-adds over d = 0..D-1 in a vector lane, whichever tile or lane it lands in (keys that are not a whole
     tile of a consecutive run, a tree path's slots among them, are first gathered into a tile);
   - exp: a branch-free Cephes polynomial, vectorized; the softmax sum keeps 16 lanes (slot j in lane j mod 16,
     padding adds exact zeros) and adds them pairwise in a fixed order;
   - output: o[d] accumulates p_j v_j[d] over j in slot order, vectorized over d;
   - a row with SPLIT or more keys is cut in two halves at a point that depends only on its number of keys, each
     half computed as above (its own max, sum and output), then merged (flash-decoding's split-KV): two threads share
     one decode step, and a row's result still depends on that row alone.
   Written with GCC/clang vector extensions; build with -O3 -march=native -ffp-contract=fast. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 16     /* floats per vector */
#define BLOCK 32  /* keys per block of scores: two vectors */
#define SPLIT 256 /* rows with this many keys or more are computed in two halves */

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
typedef float vf_u __attribute__((vector_size(64), aligned(4)));

static inline vf load_f32(const float *p) { return *(const vf_u *)p; }

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

static inline vf vselect(vi mask, vf a, vf b) { /* mask ? a : b, lane by lane (mask lanes are 0 or -1) */
    vi ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    vi r = (mask & ia) | (~mask & ib);
    vf f;
    memcpy(&f, &r, sizeof f);
    return f;
}

/* exp(x) for x <= 0 (scores minus their max): 2^n * P(r), |r| <= ln2 / 2, relative error ~2e-7 */
static inline vf exp_nonpos(vf x) {
    vf lo = (vf){0} - 87.0f;
    x = vselect(x < lo, lo, x);
    vf t = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf); /* truncation toward zero... */
    n = vselect(n > t, n - 1.0f, n);                                     /* ...made a floor (t may be < 0) */
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return p * two_n;
}

/* The kernel, instantiated for f32 and bf16 storage (T_ the element type, LD_ / ST_ its vector load / store), for a
   constant head size D and a constant number G of query heads that share a KV head (processed together: each key
   and value vector is loaded once for the G heads; each head's arithmetic is exactly what it would be alone). */
#define ATTEND_KERNEL(NAME, T_, LD_, ST_)                                                                          \
    static inline __attribute__((always_inline)) void block_##NAME(const float *q, const T_ *k, const int D,      \
                                                                   const int G, float scale, float *s, long ns) {  \
        vf a0[G], a1[G];                                                                                           \
        for (int g = 0; g < G; g++)                                                                                \
            a0[g] = a1[g] = (vf){0};                                                                               \
        for (int d = 0; d < D; d++) {                                                                              \
            vf x0 = LD_(k + d * BLOCK), x1 = LD_(k + d * BLOCK + W);                                               \
            for (int g = 0; g < G; g++) {                                                                          \
                a0[g] += q[g * D + d] * x0;                                                                        \
                a1[g] += q[g * D + d] * x1;                                                                        \
            }                                                                                                      \
        }                                                                                                          \
        for (int g = 0; g < G; g++) {                                                                              \
            store_f32(s + g * ns, a0[g] * scale);                                                                  \
            store_f32(s + g * ns + W, a1[g] * scale);                                                              \
        }                                                                                                          \
    }                                                                                                              \
                                                                                                                   \
    /* Keys j0 <= j < j1 of row t (j < np: slot lo + j of the consecutive run, then tail[j - np]) for heads        \
       h0..h0+G-1 -> part: per head its max, its sum of exp(s - max), then sum_j exp(s_j - max) v_j [D]. */        \
    static inline __attribute__((always_inline)) void NAME(                                                        \
        const T_ *kv, const T_ *kth, int Hkv, long kvh, const int D, const int G, long lo, long np,   \
        const int64_t *tail, long j0, long j1, float scale, float *s, long ns, float *qf, T_ *tmp, float *part) {  \
        const vf iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};                                    \
        long slot_stride = 2L * Hkv * D, n = j1 - j0, padded = (n + BLOCK - 1) / BLOCK * BLOCK;                    \
        float sc[G * BLOCK];                                                                                       \
        /* whole tiles inside this part of the consecutive run are read in place */                                \
        long rlo = lo + j0, rhi = lo + (j1 < np ? j1 : np);                                                        \
        rhi = rhi > rlo ? rhi : rlo;                                                                               \
        long a = (rlo + BLOCK - 1) / BLOCK * BLOCK, b = rhi / BLOCK * BLOCK;                                       \
        if (a > b)                                                                                                 \
            a = b = rhi;                                                                                           \
        for (long x = a; x < b; x += BLOCK) {                                                                      \
            for (int c = 0; c < D * BLOCK * (int)sizeof(T_); c += 64) /* the next tile */                         \
                __builtin_prefetch((const char *)(kth + (x / BLOCK + 1) * D * BLOCK) + c);                         \
            block_##NAME(qf, kth + x / BLOCK * D * BLOCK, D, G, scale, s + x - rlo, ns);                           \
        }                                                                                                          \
        /* the other keys (the run's ragged ends, then tail slots) are gathered into a tile, BLOCK at a time */     \
        long ra = a - rlo, rb = rhi - b, rest = n - (b - a);                                                       \
        for (long r0 = 0; r0 < rest; r0 += BLOCK) {                                                                \
            long at[BLOCK];                                                                                        \
            for (long c = 0; c < BLOCK; c++) {                                                                     \
                long r = r0 + c, i = r < ra ? r : r < ra + rb ? b - a + r : r + (b - a); /* index in the part */   \
                long slot = r >= rest ? -1 : j0 + i < np ? lo + j0 + i : tail[j0 + i - np];                        \
                at[c] = r < rest ? i : -1;                                                                         \
                for (int d = 0; d < D; d++)                                                                        \
                    tmp[d * BLOCK + c] = slot >= 0 ? kth[slot / BLOCK * D * BLOCK + d * BLOCK + slot % BLOCK] : 0; \
            }                                                                                                      \
            block_##NAME(qf, tmp, D, G, scale, sc, BLOCK);                                                         \
            for (long c = 0; c < BLOCK && at[c] >= 0; c++)                                                         \
                for (int g = 0; g < G; g++)                                                                        \
                    s[g * ns + at[c]] = sc[g * BLOCK + c];                                                         \
        }                                                                                                          \
        for (int g = 0; g < G; g++) { /* exp(s - max) in place, and its sum */                                     \
            float *sg = s + g * ns;                                                                                \
            vf mv = (vf){0} - 3.0e38f;                                                                             \
            for (long j = 0; j < padded; j += W) { /* the max (order-free), padding masked out */                  \
                vf x = vselect(iota + (float)j < (float)n, load_f32(sg + j), mv);                                  \
                mv = vselect(x > mv, x, mv);                                                                       \
            }                                                                                                      \
            float m = mv[0];                                                                                       \
            for (int l = 1; l < W; l++)                                                                            \
                m = mv[l] > m ? mv[l] : m;                                                                         \
            vf sum = {0};                                                                                          \
            for (long j = 0; j < padded; j += W) {                                                                 \
                vf e = vselect(iota + (float)j < (float)n, exp_nonpos(load_f32(sg + j) - m), (vf){0});             \
                store_f32(sg + j, e);                                                                              \
                sum += e;                                                                                          \
            }                                                                                                      \
            for (int w = W / 2; w > 0; w /= 2)                                                                     \
                for (int l = 0; l < w; l++)                                                                        \
                    sum[l] += sum[l + w];                                                                          \
            part[g * (D + 2)] = m;                                                                                 \
            part[g * (D + 2) + 1] = sum[0];                                                                        \
        }                                                                                                          \
        vf acc[G][D / W];                                                                                          \
        for (int g = 0; g < G; g++)                                                                                \
            for (int c = 0; c < D / W; c++)                                                                        \
                acc[g][c] = (vf){0};                                                                               \
        for (long i = 0; i < n; i++) {                                                                             \
            long slot = j0 + i < np ? lo + j0 + i : tail[j0 + i - np];                                             \
            const T_ *v = kv + slot * slot_stride + (Hkv + kvh) * D;                                               \
            for (int c = 0; c < D * (int)sizeof(T_); c += 64) /* 8 slots ahead: cut memory latency */              \
                __builtin_prefetch((const char *)(v + 8 * slot_stride) + c);                                       \
            for (int c = 0; c < D / W; c++) {                                                                      \
                vf x = LD_(v + c * W);                                                                             \
                for (int g = 0; g < G; g++)                                                                        \
                    acc[g][c] += s[g * ns + i] * x;                                                                \
            }                                                                                                      \
        }                                                                                                          \
        for (int g = 0; g < G; g++)                                                                                \
            for (int c = 0; c < D / W; c++)                                                                        \
                store_f32(part + g * (D + 2) + 2 + c * W, acc[g][c]);                                              \
    }                                                                                                              \
                                                                                                                   \
    /* One head's output from its parts: o = acc / sum for one part; for two, rescaled to their common max. */     \
    static inline __attribute__((always_inline)) void merge_##NAME(const float *p0, const float *p1, const int D,  \
                                                                   T_ *o) {                                        \
        if (!p1) {                                                                                                 \
            float inv = 1.0f / p0[1];                                                                              \
            for (int c = 0; c < D / W; c++)                                                                        \
                ST_(o + c * W, load_f32(p0 + 2 + c * W) * inv);                                                    \
            return;                                                                                                \
        }                                                                                                          \
        float m = p0[0] > p1[0] ? p0[0] : p1[0];                                                                   \
        vf e = exp_nonpos((vf){p0[0] - m, p1[0] - m});                                                             \
        float inv = 1.0f / (p0[1] * e[0] + p1[1] * e[1]);                                                         \
        for (int c = 0; c < D / W; c++)                                                                            \
            ST_(o + c * W, (load_f32(p0 + 2 + c * W) * e[0] + load_f32(p1 + 2 + c * W) * e[1]) * inv);             \
    }

ATTEND_KERNEL(attend_f32, float, load_f32, store_f32)
ATTEND_KERNEL(attend_bf16, uint16_t, load_bf16, store_bf16)

/* All (row, head group, part) units of one call, spread over OpenMP threads (the runtime PyTorch loaded: one thread
   pool), then the parts merged; each unit is computed whole by one thread, so threading changes no result. */
#define RUN(NAME, T_, LD_, DIM, GG)                                                                                \
    static int run_##NAME##_##DIM##_##GG(const T_ *q, long q_stride, const T_ *kv, const T_ *kt, long tiles,     \
                                         int H, int Hkv, int T, const int64_t *lo, const int64_t *hi,              \
                                         const int64_t *tails, const int64_t *toff, float scale, T_ *out,          \
                                         long ns) {                                                                \
        int per_row = H / GG, units = T * per_row * 2, failed = 0, group = H / Hkv;                                \
        float *parts = malloc(sizeof(float) * units * GG * (DIM + 2));                                             \
        if (!parts)                                                                                                \
            return -1;                                                                                             \
        _Pragma("omp parallel reduction(| : failed)") {                                                            \
            float *s = malloc(sizeof(float) * ns * GG), *qf = malloc(sizeof(float) * DIM * GG);                    \
            T_ *tmp = malloc(sizeof(T_) * DIM * BLOCK);                                                            \
            failed = !s || !qf || !tmp;                                                                            \
            _Pragma("omp for schedule(static)") for (int u = 0; u < units; u++) {                                  \
                int t = u / (per_row * 2), h0 = u / 2 % per_row * GG, half = u % 2;                                \
                long np = hi[t] - lo[t], n = np + toff[t + 1] - toff[t];                                           \
                long cut = n >= SPLIT ? n / 2 : n; /* depends on the row's own length only */                      \
                if (failed || (half && cut == n))                                                                  \
                    continue;                                                                                      \
                long kvh = h0 / group;                                                                             \
                for (int g = 0; g < GG; g++)                                                                       \
                    for (int d = 0; d < DIM; d += W)                                                               \
                        store_f32(qf + g * DIM + d, LD_(q + t * q_stride + (long)(h0 + g) * DIM + d));        \
                NAME(kv, kt + kvh * tiles * DIM * BLOCK, Hkv, kvh, DIM, GG, lo[t], np, tails + toff[t],         \
                     half ? cut : 0, half ? n : cut, scale, s, ns, qf, tmp, parts + (long)u * GG * (DIM + 2));     \
            }                                                                                                      \
            free(s), free(qf), free(tmp);                                                                          \
            _Pragma("omp for schedule(static)") for (int u = 0; u < units; u += 2) {                               \
                int t = u / (per_row * 2), h0 = u / 2 % per_row * GG;                                              \
                long n = hi[t] - lo[t] + toff[t + 1] - toff[t];                                                    \
                for (int g = 0; g < GG; g++) {                                                                     \
                    const float *p0 = parts + ((long)u * GG + g) * (DIM + 2);                                      \
                    const float *p1 = n >= SPLIT ? parts + ((long)(u + 1) * GG + g) * (DIM + 2) : 0;               \
                    merge_##NAME(p0, p1, DIM, out + ((long)t * H + h0 + g) * DIM);                                 \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        free(parts);                                                                                               \
        return failed ? -1 : 0;                                                                                    \
    }
#define RUNS_OF(NAME, T_, LD_, DIM)                                                                                \
    RUN(NAME, T_, LD_, DIM, 1) RUN(NAME, T_, LD_, DIM, 2) RUN(NAME, T_, LD_, DIM, 3) RUN(NAME, T_, LD_, DIM, 4)
#define RUNS(DIM) RUNS_OF(attend_f32, float, load_f32, DIM) RUNS_OF(attend_bf16, uint16_t, load_bf16, DIM)
RUNS(16)
RUNS(32)
RUNS(64)
RUNS(128)
RUNS(256)

/* q: T rows of H heads of D (row stride q_stride elements, head stride D); kv: one layer's cache [S, 2 Hkv, D]
   (keys in heads 0..Hkv-1, values in Hkv..2Hkv-1); kt: the same keys in tiles [Hkv, tiles, D, 32] (store_keys).
   Row t attends the slots lo[t] .. hi[t] - 1, then tails[toff[t] .. toff[t + 1]) (at least one slot in all);
   out: [T, H, D] contiguous. D must be 16, 32, 64, 128 or 256. Returns 0, -1 when memory runs out, -2 for an
   unsupported D. */
int specdec_attend(const void *q, long q_stride, const void *kv, const void *kt, long tiles, int H, int Hkv, int D,
                   int T, const int64_t *lo, const int64_t *hi, const int64_t *tails, const int64_t *toff,
                   float scale, void *out, int bf16) {
    long longest = 1;
    for (int t = 0; t < T; t++) {
        long n = hi[t] - lo[t] + toff[t + 1] - toff[t];
        longest = n > longest ? n : longest;
    }
    int group = H / Hkv;
    int G = group % 4 == 0 ? 4 : group % 3 == 0 ? 3 : group % 2 == 0 ? 2 : 1; /* heads processed together */
    long ns = (longest + BLOCK - 1) / BLOCK * BLOCK;
#define CALL(DIM, GG)                                                                                              \
    return bf16 ? run_attend_bf16_##DIM##_##GG(q, q_stride, kv, kt, tiles, H, Hkv, T, lo, hi, tails, toff, scale,  \
                                               out, ns)                                                            \
                : run_attend_f32_##DIM##_##GG(q, q_stride, kv, kt, tiles, H, Hkv, T, lo, hi, tails, toff, scale,   \
                                              out, ns);
#define CASE(DIM)                                                                                                  \
    case DIM:                                                                                                      \
        switch (G) {                                                                                               \
        case 4: CALL(DIM, 4)                                                                                       \
        case 3: CALL(DIM, 3)                                                                                       \
        case 2: CALL(DIM, 2)                                                                                       \
        default: CALL(DIM, 1)                                                                                      \
        }
    switch (D) {
        CASE(16) CASE(32) CASE(64) CASE(128) CASE(256)
    }
    return -2;
}

/* Copy the keys of slots start..end-1 from kv [S, 2 Hkv, D] into the tiles kt [Hkv, tiles, D, 32], for n_layers
   layers (kv_layer / kt_layer: elements between layers); esize: bytes per element (2 or 4). */
#define STORE_KEYS(T_)                                                                                             \
    for (int layer = 0; layer < n_layers; layer++)                                                                 \
        for (long x = start; x < end; x++)                                                                         \
            for (int h = 0; h < Hkv; h++) {                                                                        \
                const T_ *src = (const T_ *)kv + layer * kv_layer + (x * 2 * Hkv + h) * D;                         \
                T_ *dst = (T_ *)kt + layer * kt_layer + (h * tiles + x / BLOCK) * D * BLOCK + x % BLOCK;           \
                for (int d = 0; d < D; d++)                                                                        \
                    dst[d * BLOCK] = src[d];                                                                       \
            }
void specdec_store_keys(const void *kv, void *kt, int n_layers, long kv_layer, long kt_layer, long tiles, int Hkv,
                        int D, long start, long end, int esize) {
    if (esize == 2) {
        STORE_KEYS(uint16_t)
    } else {
        STORE_KEYS(float)
    }
}
