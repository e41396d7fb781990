/* Weight-only quantized matmul y = x W^T for decode and verification steps (CPU: AVX-512 VNNI, or AVX2 where there is
   no AVX-512, see "AVX2" below), batch-invariant.

   W [N, K] is int4 (asymmetric, one scale and zero per group of 32 inputs: w = (q - 8) s + z, i.e. GGUF Q4_1's
   w = q s + m with m = z - 8 s) or int8
   (symmetric, one scale per output row: w = q s). The activations x [T, K] are quantized on the fly to int8, one
   scale per row and group of 32 (d = max|x| / 127, as llama.cpp's Q8_1 / Q8_0 activations), so that every group's
   products are exact integer dot products (VPDPBUSD: 64 u8 x s8 products per instruction) and only the per-group
   rescaling is floating point:

     y[t, n] = sum_g (d[t, g] s[n, g]) dot_g  +  sum_g m[n, g] (d[t, g] sum_g(qx))                 (int4, m = z - 8 s)
     y[t, n] = s[n] * (sum_g d[t, g] dot_g  -  sum_g 128 d[t, g] sum_g(qx))                       (int8)

   where dot_g = sum over the group of (weight code, stored unsigned: q for int4, q + 128 for int8) * qx. The terms
   that do not involve the weight codes (d sum(qx) per row and group; for int8 the whole second sum, one number per
   row) are computed once per activation row, and m = z - 8 s (exact in f32: both are bf16) once per group and block
   of 16 outputs, so the inner loop is the 8 integer instructions and 4 float ones (int4; 2 for int8) per row, group
   and block.

   Layout: output rows in blocks of 16 (one 32-bit lane each), so no horizontal sums are needed. For a block and a
   group, instruction i (i = 0..7) covers inputs 4i..4i+3: its 64 bytes hold, lane by lane, the 4 weight codes of
   that lane's row; the activation operand is those 4 inputs' codes broadcast to every lane. int4 packs instruction
   2j in the low nibbles and 2j + 1 in the high nibbles of 64 bytes (256 bytes per block and group); int8 stores them
   as they are (512 bytes).

   Q4_K (bits = Q4K): the int4 codes as above with GGUF Q4_K's own two-level scales instead of bf16 ones, so a Q4_K
   file's weights are used exactly (d sc and dmin mn are an f16 times a 6-bit integer: exact in f32, not in bf16) and
   in 4.625 bits a weight rather than 5: per block of 16 rows and super-block of 8 groups (256 inputs), KSUPER bytes
   hold f16 d [16] and -dmin [16] (one per row), then the scale codes sc [8][16] and minimum codes mn [8][16], a byte
   each; group g's scale is d sc and its minimum factor (m above) -dmin mn, both exact products.

   Q6_K (bits = Q6K): GGUF Q6_K as it is, 6.5625 bits a weight instead of int8's 8: 6-bit codes q (0..63) with
   w = d sc (q - 32), an int8 scale sc per 16 inputs and an f16 d per 256 and row. Per block and group WGROUP6 bytes:
   the codes' low nibbles as int4's (256), then their high bit pairs in two 64-byte vectors, vector v's byte j
   holding in bits 2k, 2k + 1 those of byte j of instruction 4v + k. Instructions 0-3 cover the group's first 16
   inputs and 4-7 its last 16, so each half's dot product is a chain of its own:

     y[t, n] = sum_g d[t, g] sum_h (d sc_h) (dot_h - 32 sum_h(qx))                                            (Q6K)

   with 32 sum_h(qx) per row and half from the activations' quantization. Scales per block and super-block of 8
   groups (KSUPER6 bytes): f16 d [16], then sc [8 groups][2 halves][16] int8.

   Q5_K (bits = Q5K): Q4_K's layout and scales with each code's fifth bit (q in 0..31) in a 64-byte vector after the
   group's nibbles (WGROUP5 bytes a group), byte j's bit i that of byte j of instruction i: GGUF Q5_K as it is, 5.625
   bits a weight instead of int8's 8.

   Q5_0 / Q5_1 (bits = Q5): Q5_K's codes (nibbles and fifth-bit vector, WGROUP5 bytes a group) with the file's own
   f16 factors per group of 32 instead of bf16 ones: s holds d [G][16] and z m [G][16] (Q5_1: w = d q + m) or
   nothing (Q5_0: w = d (q - 16), so m = -16 d); m is the minimum factor itself. 5.5 bits a weight (Q5_0) or 6
   (Q5_1) instead of int8's 8.

   Every format runs on both paths, AVX-512 VNNI and AVX2, with the same integers and float operations.

   Stacked (bits = STACK): a weight whose blocks of rows are stored in different formats, e.g. a fused q|k|v of a
   Q4_K_M file whose q and k are Q4_K and v Q6_K; s is an int64 table {n, then per part: its blocks of 16 rows, bits,
   codes, scales, zeros (0: none)}, and each block is computed as its part alone would compute it.

   Batch invariance: every output (t, n) is computed by the same instructions in the same order (groups in order,
   exact integer sums inside a group) whatever T is, however rows are blocked, and whichever thread takes its block
   of 16 outputs; so row t of a verification forward over T tokens is bitwise the decode step of that token alone.
   Threads (OpenMP, the runtime PyTorch loaded) split the blocks of output rows.

   Fused around the product, so that a transformer layer is fewer small ops: an RMSNorm of each input row before it is
   quantized (x / sqrt(mean(x^2) + eps) * w, Zhang & Sennrich 2019), and after the product either SwiGLU (the weight
   is gate rows then up rows; the output is silu(gate) * up, or GELU(gate) * up (Gemma), both halves' blocks computed
   by the same thread) or a residual add (y = r + x W^T). Each is per row, so batch invariance is kept. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1
#define HAVE_AVX2 0
#include "vexp.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_VNNI 0
#define HAVE_AVX2 1 /* CPUs without AVX-512 (AMD Zen 1-3, Intel client cores before Ice Lake, ...): see AVX2 below */
#include "vexp.h"
#else
#define HAVE_VNNI 0
#define HAVE_AVX2 0
#endif
#define HAVE_KERNEL (HAVE_VNNI || HAVE_AVX2)
#if HAVE_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define GROUP 32
#ifndef OWN_ROWS /* calls of up to this many rows quantize them in every thread, into its own kept buffers: no barrier
                     and no malloc per call; SmolLM2 decode steps 1.03x, T = 2-4 1.01-1.03x, 8 rows unchanged
                     (docs/results/own-rows-1207d.txt) */
#define OWN_ROWS 4
#endif
#define LANES 16
#define Q4K 20      /* bits: int4 codes with Q4_K's scales (see the header) */
#define KSUPER 320  /* bytes of Q4_K scales per block of 16 rows and super-block of 8 groups */
#define KGROUPS 8   /* groups a super-block */
#define Q6K 22       /* bits: Q6_K's codes and scales (see the header) */
#define KSUPER6 288  /* bytes of Q6_K scales per block of 16 rows and super-block */
#define WGROUP6 384  /* bytes of Q6_K codes per block of 16 rows and group */
#define STACK 30     /* bits: parts in different formats (see the header) */
#define Q5K 21       /* bits: Q5_K's codes and scales (see the header) */
#define WGROUP5 320  /* bytes of Q5_K codes per block of 16 rows and group */
#define Q5 23        /* bits: Q5_0's / Q5_1's codes and f16 factors (see the header) */
#define WIDEN 2 /* specdec_matmul's bf16 = 2: bf16 inputs, outputs rounded to bf16 and stored widened to f32 */
/* activation rows per pass over a block's weights (register blocking). AVX-512: one accumulator a row in the pass
   (int4's minimum term fused into it only up to YM_FUSED_MAX rows, else in a pass of its own), up to 9 rows, and
   passes of AMX_MIN_ROWS..16 rows on tiles where the CPU has AMX. In whole forwards of the 1B-shaped Q4_0 file at 256
   cached tokens (docs/results/forward-ab-rows9-amx10.txt, against 6 int4 / 8 int8 rows a pass, two accumulators,
   tiles for whole 16-row tiles only): T = 7..12 1.20x faster (T = 9 55.7 -> 46.2 ms), T = 1 1.05x, T = 16 1.07x;
   10 rows on VNNI or tiles below 10 rows were slower (T = 8 on tiles 45.6 ms against 42.1). */
#if HAVE_VNNI
#ifndef VNNI_ROWS4
#define VNNI_ROWS4 9
#endif
#ifndef VNNI_ROWS8
#define VNNI_ROWS8 9
#endif
#define ROWS4 VNNI_ROWS4
#define ROWS8 VNNI_ROWS8
#ifndef YM_FUSED_MAX
#define YM_FUSED_MAX 6
#endif
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 10
#endif
#if AMX_MIN_ROWS < 10
#error "AMX_CASES below instantiates tile heights 10..16 only"
#endif
#else /* AVX2: 16 vector registers, not 32; both halves of a block a pass, int4's minimum term fused up to 3 rows
         (docs/results/avx2-matmul.txt; docs/results/avx2-onepass-1206.txt); int8 3 rows a pass (2 and 4 measured
         within 3% of 3 for the SmolLM2 head, docs/results/int8-sign-1206g.txt) */
#define ROWS4 AVX2_ROWS4
#define ROWS8 AVX2_ROWS8
#define YM_FUSED_MAX AVX2_YM_FUSED_MAX
#endif
#ifndef AVX2_ROWS4
#define AVX2_ROWS4 4
#endif
#ifndef AVX2_ROWS8
#define AVX2_ROWS8 3
#endif
#ifndef AVX2_YM_FUSED_MAX
#define AVX2_YM_FUSED_MAX 3
#endif
#ifndef PREFETCH /* bytes of int4 codes (twice that of int8) fetched ahead into L1; 0: none */
#if HAVE_VNNI /* 3 KB until a host with twice the memory bandwidth decoded 1.07-1.12x faster at 6 KB (8B-, 1B-shaped,
                 SmolLM2; T = 9 and 8 sequences unchanged: docs/results/prefetch-6k-1207.txt) */
#define PREFETCH 6144
#else /* AVX2: on the 12-03 EPYC host 1 KB decoded the 8B- and 1B-shaped files ~5% faster than 3 KB
         (docs/results/prefetch-avx2.txt) */
#define PREFETCH 1024
#endif
#endif

#ifndef PF_MIN_ROWS8 /* VNNI int8 passes of fewer rows prefetch nothing: one row's pass streams its 512-byte groups
                       faster on the hardware prefetcher alone (a line-by-line software prefetch cost more than it
                       hid): Zen 4, SmolLM2 decode step 1.07x (its int8 head), Gemma-3-270M 1.28x (int8 layers and
                       head), T = 2 and 8 sequences unchanged (docs/results/int8-prefetch-1207.txt) */
#define PF_MIN_ROWS8 2
#endif

#ifndef PREFETCH_L2_ROWS /* VNNI passes of up to this many rows prefetch into L2, longer ones into L1 */
#define PREFETCH_L2_ROWS 9
#endif
/* Decode and short verifications are memory-bound: prefetching into L2 rather than L1 made an 8B-shaped Q4_0 forward
   188.5 -> 176.0 ms, a 1B-shaped one 31.9 -> 29.1 ms and T = 2-3 1.02-1.07x faster; at T = 4 and 8 it changed nothing
   (Sapphire Rapids, docs/results/prefetch-l2-1204.txt). Passes of 5-9 rows went on prefetching into L1 until, on a
   Zen 4 host, L2 made them faster too: 8B-shaped Q4_K_M T = 5 / 9 1.16x / 1.09x, 1B-shaped T = 5 / 7 1.12x / 1.05x,
   SmolLM2 T = 5-16 1.02-1.05x, 8 sequences 1.02-1.03x (docs/results/prefetch-l2-rows-1206h.txt). */
#define PREFETCH_ROWS(nt, p)                                                                                          \
    do {                                                                                                              \
        if ((nt) <= PREFETCH_L2_ROWS)                                                                                 \
            _mm_prefetch((p), _MM_HINT_T1);                                                                           \
        else                                                                                                          \
            _mm_prefetch((p), _MM_HINT_T0);                                                                           \
    } while (0)

/* T activation rows quantized to int8 (quantize_rows): codes q [T, K]; per row and group of 32 inputs the scale
   d [T, G] (max|x| / 127), the codes' sum [T, G] and ds = d sum [T, G]; per row c [T] = sum over groups of 128 ds (the
   int8 weights' offset, see the header); per row, group and half of 16 inputs h32 [T, G, 2] = 32 x the half's sum
   (Q6_K's offset). */
typedef struct {
    int8_t *q;
    float *d, *ds, *c;
    int32_t *sum, *h32;
} qrows;

/* rows r0, r0 + 1, ... of x (G groups of K inputs a row) */
static inline qrows qrows_at(const qrows *x, long r0, int G, int K) {
    return (qrows){x->q + r0 * K, x->d + r0 * G, x->ds + r0 * G, x->c + r0, x->sum + r0 * G, x->h32 + r0 * G * 2};
}

/* Which path this build runs: 2 AVX-512 VNNI, 1 AVX2, 0 none (the kernel is not used). */
int specdec_matmul_supported(void) { return HAVE_VNNI ? 2 : HAVE_AVX2; }

/* AMX (Intel Advanced Matrix Extensions): one TDPBSUD instruction computes a 16-row x 16-output tile of a group's
   integer dot products, the work of 16 x 8 VPDPBUSD instructions. Used for every pass over 2 or more activation rows
   (verification, batches, prefill) where the CPU has it and the kernel asks the OS for the tile state (Linux's
   ARCH_REQ_XCOMP_PERM); the float rescaling after it is the VNNI path's, instruction for instruction, and the integer
   dot products are exact in both, so a row's output is bitwise the same on either path (batch invariance holds
   across them: a decode step of one row takes the VNNI path). */
static int amx_on = 0;

#if HAVE_AMX
#define AMX_ROWS 16
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;
static __thread int amx_rows = 0; /* rows of the tile configuration this thread last loaded (0: load it again) */

/* Tiles: 0-3 = C (int32 [nt, 16]) of four consecutive groups (int8) or of two pairs (int4, pipelined), 4-5 = A
   (activation codes, s8 [nt, 32]), 6-7 = B (weight codes, u8 [8, 64]: the VNNI layout of a block and group is
   already AMX's packed B layout, four inputs of each of 16 outputs per row). Tiles are not renamed: several groups in
   flight let their loads and products overlap. */
static inline void amx_configure(int nt) {
    if (amx_rows == nt) return;
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = nt, cfg.colsb[t] = 64;
    for (int t = 4; t < 6; t++) cfg.rows[t] = nt, cfg.colsb[t] = GROUP;
    for (int t = 6; t < 8; t++) cfg.rows[t] = GROUP / 4, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    amx_rows = nt;
}
#endif

/* Turn the AMX path on (1) or off (0); returns whether it is on: 0 when the CPU, the build or the OS has no AMX. */
int specdec_matmul_amx(int on) {
#if HAVE_AMX
    if (on) {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return amx_on = 0;
        if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return amx_on = 0;
    }
    return amx_on = on != 0;
#else
    (void)on;
    return amx_on = 0;
#endif
}

#if HAVE_VNNI

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 load_out(const void *p, int bf16, long i) {
    return bf16 ? load_bf16x16((const uint16_t *)p + i) : _mm512_loadu_ps((const float *)p + i);
}

/* Quantize rows t0 .. t1 - 1 of x [T, K] (f32 or bf16), RMS-normalized first when norm (f32 [K]) is given, into o
   (see qrows; codes round to nearest even, as nearbyintf). Each row on its own: any split of the rows over threads
   gives the same bits. */
static void quantize_rows(const void *x, int bf16, int t0, int t1, int K, const float *norm, float eps,
                          const qrows *o) {
    int8_t *qx = o->q;
    float *d = o->d, *ds = o->ds, *c = o->c;
    int G = K / GROUP;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int t = t0; t < t1; t++) {
        __m512 r = _mm512_set1_ps(1.0f);
        if (norm) {
            __m512 ss = _mm512_setzero_ps();
            for (int k = 0; k < K; k += LANES) {
                __m512 v = load_out(x, bf16, (long)t * K + k);
                ss = _mm512_fmadd_ps(v, v, ss);
            }
            r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)K + eps));
        }
        for (int g = 0; g < G; g++) {
            long k = (long)g * GROUP;
            __m512 v0 = load_out(x, bf16, (long)t * K + k), v1 = load_out(x, bf16, (long)t * K + k + LANES);
            if (norm) {
                v0 = _mm512_mul_ps(_mm512_mul_ps(v0, r), _mm512_loadu_ps(norm + k));
                v1 = _mm512_mul_ps(_mm512_mul_ps(v1, r), _mm512_loadu_ps(norm + k + LANES));
            }
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
            __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
            _mm_storeu_si128((__m128i *)(qx + (long)t * K + k), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(qx + (long)t * K + k + LANES), _mm512_cvtsepi32_epi8(q1));
            float dg = amax / 127.0f;
            d[(long)t * G + g] = dg;
            int32_t h0 = _mm512_reduce_add_epi32(q0), h1 = _mm512_reduce_add_epi32(q1), sum = h0 + h1;
            o->h32[((long)t * G + g) * 2] = 32 * h0, o->h32[((long)t * G + g) * 2 + 1] = 32 * h1;
            o->sum[(long)t * G + g] = sum;
            ds[(long)t * G + g] = dg * (float)sum;
            c[t] += 128.0f * ds[(long)t * G + g];
        }
    }
}

/* g sigmoid(x) u with exp taken of -|x| only: e = exp(-|x|), sigmoid = 1 / (1 + e) for x >= 0, e / (1 + e) below
   (x has g's sign in both uses below, so the sign is g's) */
static inline __m512 sigmoid_mul(__m512 g, __m512 x, __m512 u) {
    __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
    return _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(e, _mm512_set1_ps(1.0f))), u);
}

/* silu(g) * u = g sigmoid(g) u */
static inline __m512 silu_mul(__m512 g, __m512 u) { return sigmoid_mul(g, g, u); }

/* GELU (tanh approximation, Hendrycks & Gimpel 2016) of g, times u: 0.5 g (1 + tanh(z)) = g sigmoid(2 z) u with
   z = sqrt(2 / pi) (g + 0.044715 g^3) */
static inline __m512 gelu_mul(__m512 g, __m512 u) {
    __m512 z2 = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f), g),
                              _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), _mm512_mul_ps(g, g), _mm512_set1_ps(1.0f)));
    return sigmoid_mul(g, z2, u);
}

/* y stored at out + i: bf16 1, rounded to bf16 (to nearest even, as torch does); WIDEN, rounded the same and stored
   as the f32 it widens to; 0, f32 as computed */
static inline void store_out(void *out, int bf16, long i, __m512 y) {
    if (bf16) {
        __m512i u = _mm512_castps_si512(y);
        u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                  _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        if (bf16 == WIDEN)
            _mm512_storeu_si512((float *)out + i, _mm512_andnot_si512(_mm512_set1_epi32(0xFFFF), u));
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    } else {
        _mm512_storeu_ps((float *)out + i, y);
    }
}

/* The minimum term's per-output factor of group g: z - 8 s; symmetric weights (GGUF Q4_0: z = 0) store no zeros, and
   -8 s is the same number */
static inline __m512 min_scale(__m512 sg, const uint16_t *z, int g) {
    return z ? _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sg, load_bf16x16(z + (long)g * LANES))
             : _mm512_mul_ps(_mm512_set1_ps(-8.0f), sg);
}

/* Group g's scale (which = 0: d sc) or minimum factor (1: -dmin mn) from a block's Q4_K scales m (see the header) */
static inline __m512 kq_factor(const uint16_t *m, int g, int which) {
    const uint8_t *sb = (const uint8_t *)m + (long)(g / KGROUPS) * KSUPER;
    __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32 * which)));
    __m128i c = _mm_loadu_si128((const __m128i *)(sb + 2 * 32 + KGROUPS * LANES * which + LANES * (g % KGROUPS)));
    return _mm512_mul_ps(f, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c)));
}

static inline __m512 load_f16x16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Group g's scale of a block: kq 0 (int4): bf16 s; 1, 2 (Q4_K's scales, Q5_K): d sc; 3 (Q5_0 / Q5_1): f16 d */
static inline __m512 group_scale(const uint16_t *s, int g, const int kq) {
    return kq == 3 ? load_f16x16(s + (long)g * LANES) : kq ? kq_factor(s, g, 0) : load_bf16x16(s + (long)g * LANES);
}

/* Group g's minimum factor (m in the header) given its scale sg, by kq as group_scale */
static inline __m512 group_min(__m512 sg, const uint16_t *s, const uint16_t *z, int g, const int kq) {
    if (kq == 3) return z ? load_f16x16(z + (long)g * LANES) : _mm512_mul_ps(_mm512_set1_ps(-16.0f), sg);
    return kq ? kq_factor(s, g, 1) : min_scale(sg, z, g);
}

/* The minimum term of rows [t0, t0 + nt) over every group, one chain a row (the same sums wherever it runs); kq as
   group_scale */
static inline __attribute__((always_inline)) void min_term(const uint16_t *s, const uint16_t *z, const int kq, int G,
                                                           const float *ds, int t0, const int nt, __m512 *ym) {
    for (int g = 0; g < G; g++) {
        __m512 mg = group_min(group_scale(s, g, kq), s, z, g, kq);
        for (int r = 0; r < nt; r++) ym[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(ds[(long)(t0 + r) * G + g]), ym[r]);
    }
}

/* A block's group of int4 codes (256 bytes at wg: instruction 2j in the low nibbles of vector j, 2j + 1 in the high
   ones) as the 8 code vectors u of VPDPBUSD */
static inline void nibbles(const uint8_t *wg, __m512i u[8]) {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        __m512i p = _mm512_loadu_si512((const void *)(wg + 64 * j));
        u[2 * j] = _mm512_and_si512(p, lo);
        u[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), lo);
    }
}

/* One activation row's 16 integer dot products with a group's weight codes u (8 vectors, see the header). */
static inline __m512i group_dot(const __m512i u[8], const int8_t *q) {
    /* two independent chains of 4 (VPDPBUSD's latency is ~5 cycles), added at the end: integer sums, so the
       association changes nothing in the result */
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    for (int i = 0; i < 8; i += 2) {
        int32_t b0, b1;
        memcpy(&b0, q + 4 * i, 4);
        memcpy(&b1, q + 4 * i + 4, 4);
        a0 = _mm512_dpbusd_epi32(a0, u[i], _mm512_set1_epi32(b0));
        a1 = _mm512_dpbusd_epi32(a1, u[i + 1], _mm512_set1_epi32(b1));
    }
    return _mm512_add_epi32(a0, a1);
}

/* One block of 16 output rows for rows [t0, t0 + nt) of x, nt <= ROWS4: the scale term over every group (one FMA
   per row and group), then the minimum term in its own pass (its own chain, as before: the same sums), so a pass
   keeps one accumulator a row in registers and takes up to ROWS4 rows. Inlined with nt a constant (ROW_CASES
   below): with nt a variable GCC kept the accumulators on the stack. kq: 1: s holds Q4_K scales (see the header);
   2: and the codes are Q5_K's (a fifth bit); 3: Q5_0's / Q5_1's fifth bits and f16 factors. */
static inline __attribute__((always_inline)) void block_int4_n(const uint8_t *w, const uint16_t *s, const uint16_t *z,
                                                               const int kq, int G, const int8_t *qx, const float *d,
                                                               const float *ds, int K, int t0, const int nt,
                                                               float *acc_out) {
    __m512 y[ROWS4], ym[ROWS4];
    for (int r = 0; r < ROWS4; r++) y[r] = ym[r] = _mm512_setzero_ps();
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    const int ksuper = kq == 1 || kq == 2; /* s holds Q4_K's scales by super-block */
    for (int g = 0; g < G; g++) {
        const uint8_t *wg = w + (long)g * (kq >= 2 ? WGROUP5 : 256);
#if PREFETCH
        for (int j = 0; j < (kq >= 2 ? 5 : 4); j++) PREFETCH_ROWS(nt, (const char *)(wg + PREFETCH + 64 * j));
        PREFETCH_ROWS(nt, ksuper ? (const char *)s + (long)g * (KSUPER / KGROUPS) + PREFETCH * KSUPER / (KGROUPS * 256)
                                 : (const char *)(s + (long)g * LANES + PREFETCH / 8));
        if (z) PREFETCH_ROWS(nt, (const char *)(z + (long)g * LANES + PREFETCH / 8));
#endif
        __m512i u[8];
        nibbles(wg, u);
        if (kq >= 2) { /* Q5_K, Q5_0, Q5_1: instruction i's fifth bits at bit i, moved to bit 4 (VPTERNLOGD) */
            __m512i h = _mm512_loadu_si512((const void *)(wg + 256));
            u[0] = _mm512_ternarylogic_epi32(u[0], _mm512_slli_epi16(h, 4), bit4, 0xF8);
            u[1] = _mm512_ternarylogic_epi32(u[1], _mm512_slli_epi16(h, 3), bit4, 0xF8);
            u[2] = _mm512_ternarylogic_epi32(u[2], _mm512_slli_epi16(h, 2), bit4, 0xF8);
            u[3] = _mm512_ternarylogic_epi32(u[3], _mm512_slli_epi16(h, 1), bit4, 0xF8);
            u[4] = _mm512_ternarylogic_epi32(u[4], h, bit4, 0xF8);
            u[5] = _mm512_ternarylogic_epi32(u[5], _mm512_srli_epi16(h, 1), bit4, 0xF8);
            u[6] = _mm512_ternarylogic_epi32(u[6], _mm512_srli_epi16(h, 2), bit4, 0xF8);
            u[7] = _mm512_ternarylogic_epi32(u[7], _mm512_srli_epi16(h, 3), bit4, 0xF8);
        }
        __m512 sg = group_scale(s, g, kq);
        for (int r = 0; r < nt; r++) {
            __m512i a = group_dot(u, qx + (long)(t0 + r) * K + (long)g * GROUP);
            y[r] = _mm512_fmadd_ps(_mm512_mul_ps(sg, _mm512_set1_ps(d[(long)(t0 + r) * G + g])), _mm512_cvtepi32_ps(a),
                                   y[r]);
        }
        if (nt <= YM_FUSED_MAX) { /* few rows: the minimum term in this loop, registers to spare */
            __m512 mg = group_min(sg, s, z, g, kq);
            for (int r = 0; r < nt; r++) ym[r] = _mm512_fmadd_ps(mg, _mm512_set1_ps(ds[(long)(t0 + r) * G + g]), ym[r]);
        }
    }
    if (nt > YM_FUSED_MAX) min_term(s, z, kq, G, ds, t0, nt, ym);
    for (int r = 0; r < nt; r++) _mm512_storeu_ps(acc_out + r * LANES, _mm512_add_ps(y[r], ym[r]));
}

/* One block of 16 output rows of a Q6_K weight (bits Q6K, see the header) for rows [t0, t0 + nt), nt <= ROWS4: per
   group its 8 code vectors (low nibbles | high pairs << 4), each half's dot product less 32 times the half's code
   sum (exact integers), scaled by d sc of the half and by the row's d. Inlined with nt a constant, as block_int4_n. */
static inline __attribute__((always_inline)) void block_int6_n(const uint8_t *w, const uint16_t *s, int G,
                                                               const int8_t *qx, const float *d, const int32_t *h32,
                                                               int K, int t0, const int nt, float *acc_out) {
    __m512 y[ROWS4];
    for (int r = 0; r < ROWS4; r++) y[r] = _mm512_setzero_ps();
    const __m512i pair = _mm512_set1_epi8(0x30);
    for (int g = 0; g < G; g++) {
        const uint8_t *wg = w + (long)g * WGROUP6;
#if PREFETCH
        for (int j = 0; j < 6; j++) PREFETCH_ROWS(nt, (const char *)(wg + PREFETCH * 3 / 2 + 64 * j));
        PREFETCH_ROWS(nt, (const char *)s + (long)g * (KSUPER6 / KGROUPS) + PREFETCH * KSUPER6 / (KGROUPS * 256));
#endif
        __m512i u[8];
        nibbles(wg, u);
        for (int v = 0; v < 2; v++) { /* instruction 4v + k's high pair at bits 2k, 2k + 1, moved to bits 4, 5 and
                                         or-ed in (u | (h & pair): one VPTERNLOGD, 0xF8) */
            __m512i h = _mm512_loadu_si512((const void *)(wg + 256 + 64 * v));
            u[4 * v] = _mm512_ternarylogic_epi32(u[4 * v], _mm512_slli_epi16(h, 4), pair, 0xF8);
            u[4 * v + 1] = _mm512_ternarylogic_epi32(u[4 * v + 1], _mm512_slli_epi16(h, 2), pair, 0xF8);
            u[4 * v + 2] = _mm512_ternarylogic_epi32(u[4 * v + 2], h, pair, 0xF8);
            u[4 * v + 3] = _mm512_ternarylogic_epi32(u[4 * v + 3], _mm512_srli_epi16(h, 2), pair, 0xF8);
        }
        const uint8_t *sb = (const uint8_t *)s + (long)(g / KGROUPS) * KSUPER6;
        __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        const uint8_t *sc = sb + 32 + 2 * LANES * (g % KGROUPS);
        __m512 s0 = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))));
        __m512 s1 = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(
                                          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + LANES)))));
        for (int r = 0; r < nt; r++) {
            const int8_t *q = qx + (long)(t0 + r) * K + (long)g * GROUP;
            const int32_t *o = h32 + ((long)(t0 + r) * G + g) * 2; /* each chain starts at -32 sum_h(qx) */
            __m512i a0 = _mm512_set1_epi32(-o[0]), a1 = _mm512_set1_epi32(-o[1]);
            for (int i = 0; i < 4; i++) {
                int32_t b0, b1;
                memcpy(&b0, q + 4 * i, 4);
                memcpy(&b1, q + 16 + 4 * i, 4);
                a0 = _mm512_dpbusd_epi32(a0, u[i], _mm512_set1_epi32(b0));
                a1 = _mm512_dpbusd_epi32(a1, u[4 + i], _mm512_set1_epi32(b1));
            }
            __m512 t = _mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(a1), _mm512_mul_ps(s0, _mm512_cvtepi32_ps(a0)));
            y[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[(long)(t0 + r) * G + g]), t, y[r]);
        }
    }
    for (int r = 0; r < nt; r++) _mm512_storeu_ps(acc_out + r * LANES, y[r]);
}

static inline __attribute__((always_inline)) void block_int8_n(const uint8_t *w, const uint16_t *s, int G,
                                                               const int8_t *qx, const float *d, const float *c,
                                                               const int32_t *sum, int K, int t0, const int nt,
                                                               float *acc_out) {
    (void)sum; /* VPDPBUSD takes the unsigned codes as they are */
    __m512 y[ROWS8];
    for (int r = 0; r < ROWS8; r++) y[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *wg = w + (long)g * 512;
#if PREFETCH
        if (nt >= PF_MIN_ROWS8)
            for (int j = 0; j < 8; j++) PREFETCH_ROWS(nt, (const char *)(wg + 2 * PREFETCH + 64 * j));
#endif
        __m512i u[8];
        for (int i = 0; i < 8; i++) u[i] = _mm512_loadu_si512((const void *)(wg + 64 * i));
        for (int r = 0; r < nt; r++) {
            __m512i a = group_dot(u, qx + (long)(t0 + r) * K + (long)g * GROUP);
            y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(d[(long)(t0 + r) * G + g]), y[r]);
        }
    }
    __m512 sr = load_bf16x16(s);
    for (int r = 0; r < nt; r++)
        _mm512_storeu_ps(acc_out + r * LANES, _mm512_mul_ps(_mm512_sub_ps(y[r], _mm512_set1_ps(c[t0 + r])), sr));
}

/* The 16 outputs of one row and block from acc (f32 [16]): SwiGLU with up (the block's up half) when given (GELU
   in place of SiLU with gelu), the residual added when given, stored at y + i. */
static inline void out16(const float *acc, const float *up, int gelu, const void *residual, void *y, int bf16,
                         long i) {
    __m512 v = _mm512_loadu_ps(acc);
    if (up) v = gelu ? gelu_mul(v, _mm512_loadu_ps(up)) : silu_mul(v, _mm512_loadu_ps(up));
    if (residual) v = _mm512_add_ps(load_out(residual, bf16, i), v);
    store_out(y, bf16, i, v);
}

#elif HAVE_AVX2

/* AVX2 (no AVX-512): the same layout, integer dot products and float operations as the AVX-512 path above, 8 lanes
   at a time. There is no VPDPBUSD: VPMADDUBSW multiplies u8 weight codes by s8 activation codes and adds pairs into
   s16, VPMADDWD by ones adds those pairs into s32. The s16 sums stay exact: an int4 code is at most 15 and an
   activation code at most 127 in magnitude, so one s16 slot, summing 2 products for each of a group's 8
   instructions (16 products), stays within 16 x 15 x 127 = 30480 < 32767; int8 codes (q + 128, up to 255) go
   through their signed value q and its sign (block_int8_n below). So every group's dot product
   is the exact integer VPDPBUSD gives, and the float operations on it are the AVX-512 path's, in the same order
   (the minimum term of int4 accumulates in its own chain there too, so here it runs as its own pass); the RMSNorm
   sum reduces in _mm512_reduce_add_ps's order. A block of 16 outputs runs as two halves of 8 lanes. */

static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 load_out8(const void *p, int bf16, long i) {
    return bf16 ? load_bf16x8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* The sum of a 16-float vector held as lanes 0-7 (lo) and 8-15 (hi), in GCC's _mm512_reduce_add_ps order. */
static inline float reduce_add16(__m256 lo, __m256 hi) {
    __m256 t3 = _mm256_add_ps(hi, lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

static inline float reduce_max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(m, _mm_shuffle_ps(m, m, 1)));
}

static inline int reduce_add8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

/* quantize_rows of the AVX-512 path (see there), 8 lanes at a time */
static void quantize_rows(const void *x, int bf16, int t0, int t1, int K, const float *norm, float eps,
                          const qrows *o) {
    int8_t *qx = o->q;
    float *d = o->d, *ds = o->ds, *c = o->c;
    int G = K / GROUP;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' 128-bit interleave */
    for (int t = t0; t < t1; t++) {
        __m256 r = _mm256_set1_ps(1.0f);
        if (norm) {
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            for (int k = 0; k < K; k += LANES) {
                __m256 a = load_out8(x, bf16, (long)t * K + k), b = load_out8(x, bf16, (long)t * K + k + 8);
                lo = _mm256_fmadd_ps(a, a, lo);
                hi = _mm256_fmadd_ps(b, b, hi);
            }
            r = _mm256_set1_ps(1.0f / sqrtf(reduce_add16(lo, hi) / (float)K + eps));
        }
        for (int g = 0; g < G; g++) {
            long k = (long)g * GROUP;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = load_out8(x, bf16, (long)t * K + k + 8 * j);
                if (norm) v[j] = _mm256_mul_ps(_mm256_mul_ps(v[j], r), _mm256_loadu_ps(norm + k + 8 * j));
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
            }
            float amax = reduce_max8(m);
            __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m256i q[4];
            for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(qx + (long)t * K + k), _mm256_permutevar8x32_epi32(p, order));
            float dg = amax / 127.0f;
            d[(long)t * G + g] = dg;
            int32_t h0 = reduce_add8i(_mm256_add_epi32(q[0], q[1])), h1 = reduce_add8i(_mm256_add_epi32(q[2], q[3]));
            o->h32[((long)t * G + g) * 2] = 32 * h0, o->h32[((long)t * G + g) * 2 + 1] = 32 * h1;
            int32_t total = h0 + h1;
            o->sum[(long)t * G + g] = total;
            ds[(long)t * G + g] = dg * (float)total;
            c[t] += 128.0f * ds[(long)t * G + g];
        }
    }
}

/* sigmoid_mul, silu_mul and gelu_mul of the AVX-512 path */
static inline __m256 sigmoid_mul8(__m256 g, __m256 x, __m256 u) {
    __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)));
    __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(e, _mm256_set1_ps(1.0f))), u);
}

static inline __m256 silu_mul8(__m256 g, __m256 u) { return sigmoid_mul8(g, g, u); }

static inline __m256 gelu_mul8(__m256 g, __m256 u) {
    __m256 z2 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f), g),
                              _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(g, g), _mm256_set1_ps(1.0f)));
    return sigmoid_mul8(g, z2, u);
}

static inline void store_out8(void *out, int bf16, long i, __m256 y) { /* store_out's three ways, 8 lanes */
    if (bf16) {
        __m256i u = _mm256_castps_si256(y);
        u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                                  _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
        if (bf16 == WIDEN) {
            _mm256_storeu_si256((__m256i *)((float *)out + i), _mm256_andnot_si256(_mm256_set1_epi32(0xFFFF), u));
            return;
        }
        __m256i h = _mm256_packus_epi32(_mm256_srli_epi32(u, 16), _mm256_setzero_si256());
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_castsi256_si128(_mm256_permute4x64_epi64(h, 0x08)));
    } else {
        _mm256_storeu_ps((float *)out + i, y);
    }
}

static inline void out16(const float *acc, const float *up, int gelu, const void *residual, void *y, int bf16,
                         long i) {
    for (int h = 0; h < 2; h++) {
        __m256 v = _mm256_loadu_ps(acc + 8 * h);
        if (up) v = gelu ? gelu_mul8(v, _mm256_loadu_ps(up + 8 * h)) : silu_mul8(v, _mm256_loadu_ps(up + 8 * h));
        if (residual) v = _mm256_add_ps(load_out8(residual, bf16, i + 8 * h), v);
        store_out8(y, bf16, i + 8 * h, v);
    }
}

static inline __m256i bcast4(const int8_t *q) {
    int32_t b;
    memcpy(&b, q, 4);
    return _mm256_set1_epi32(b);
}

/* kq_factor of the AVX-512 path, half h of the block's 16 rows */
static inline __m256 kq_factor8(const uint16_t *m, int g, int which, int h) {
    const uint8_t *sb = (const uint8_t *)m + (long)(g / KGROUPS) * KSUPER;
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 32 * which + 16 * h)));
    const uint8_t *codes = sb + 2 * 32 + KGROUPS * LANES * which + LANES * (g % KGROUPS) + 8 * h;
    __m128i c = _mm_loadl_epi64((const __m128i *)codes);
    return _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)));
}

static inline __m256 load_f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* group_scale of the AVX-512 path, half h */
static inline __m256 group_scale8(const uint16_t *s, int g, const int kq, int h) {
    const uint16_t *at = s + (long)g * LANES + 8 * h;
    return kq == 3 ? load_f16x8(at) : kq ? kq_factor8(s, g, 0, h) : load_bf16x8(at);
}

/* group_min of the AVX-512 path for half h (sg: the group's scale; unused with Q4_K scales, kq 1 and 2) */
static inline __m256 min_scale8(__m256 sg, const uint16_t *s, const uint16_t *z, const int kq, int g, int h) {
    if (kq == 3) return z ? load_f16x8(z + (long)g * LANES + 8 * h) : _mm256_mul_ps(_mm256_set1_ps(-16.0f), sg);
    if (kq) return kq_factor8(s, g, 1, h);
    return z ? _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), sg, load_bf16x8(z + (long)g * LANES + 8 * h))
             : _mm256_mul_ps(_mm256_set1_ps(-8.0f), sg);
}

/* block_int4 of the AVX-512 path (see there) for rows [t0, t0 + nt), nt <= ROWS4: the scale term over every group
   (one VPMADDWD per row, group and half of the block: the s16 sums of a group's 4 x 2 instructions) and the minimum
   term (its own chain in both paths, so the same sums), in the same loop up to YM_FUSED_MAX rows (T = 1-3 products
   1.06-1.09x faster, beyond that spills; avx2-onepass-1206.txt), else after it. Both halves of the block (8 lanes
   each) in one pass over its codes, each 64-byte line used whole when it arrives: a pass per half read the codes
   from memory in the first and from L2 in the second, with the memory bus idle meanwhile (on Zen 2, 8B-shaped
   products at T = 1 17-20 -> 22-26 GB/s, docs/results/avx2-onepass-1206.txt). Inlined with nt a constant
   (block_int4 below): with nt known the row loops unroll and the accumulators stay in registers; with nt a variable
   GCC 12 kept them on the stack (a load and a store around every add) and branched on nt in the inner loop.
   5-bit codes (kq 2, 3: Q5_K, Q5_0 / Q5_1): each code's fifth bit or-ed in from the group's bit vector (see the
   header), and the s16 pair sums widened to s32 at every step (VPMADDWD by ones): 16 products of codes up to 31 could
   overflow an s16 lane, 4 cannot. */
static inline __attribute__((always_inline)) void block_int4_n(const uint8_t *w, const uint16_t *s, const uint16_t *z,
                                                               const int kq, int G, const int8_t *qx, const float *d,
                                                               const float *ds, int K, int t0, const int nt,
                                                               float *acc_out) {
    const __m256i lo = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), bit4 = _mm256_set1_epi8(0x10);
    __m256 y[2][ROWS4], ym[2][ROWS4];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < ROWS4; r++) y[h][r] = ym[h][r] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *wg = w + (long)g * (kq >= 2 ? WGROUP5 : 256);
#if PREFETCH
        for (int j = 0; j < (kq >= 2 ? 5 : 4); j++) _mm_prefetch((const char *)(wg + PREFETCH + 64 * j), _MM_HINT_T0);
#endif
        __m256i a[2][ROWS4]; /* s16 pair sums (s32 for 5-bit codes) */
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < ROWS4; r++) a[h][r] = _mm256_setzero_si256();
        _Pragma("GCC unroll 1") /* unrolled, GCC 12 hoisted the 4 steps' loads and spilled: ~1.2x slower */
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                __m256i p = _mm256_loadu_si256((const __m256i *)(wg + 64 * j + 32 * h));
                __m256i u0 = _mm256_and_si256(p, lo), u1 = _mm256_and_si256(_mm256_srli_epi16(p, 4), lo);
                if (kq >= 2) { /* instruction i's fifth bits at bit i of the bit vector, moved to bit 4 */
                    __m256i b = _mm256_loadu_si256((const __m256i *)(wg + 256 + 32 * h));
                    if (j < 2) b = _mm256_slli_epi16(b, 4); /* instructions 0-3 from b << 4, 4-7 from b */
                    const int i0 = j < 2 ? 2 * j : 2 * j - 4; /* where instruction 2j's bit is in b */
                    u0 = _mm256_or_si256(u0, _mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(i0)), bit4));
                    u1 = _mm256_or_si256(u1, _mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(i0 + 1)), bit4));
                }
                for (int r = 0; r < nt; r++) {
                    const int8_t *q = qx + (long)(t0 + r) * K + (long)g * GROUP + 8 * j;
                    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, bcast4(q)),
                                                     _mm256_maddubs_epi16(u1, bcast4(q + 4)));
                    a[h][r] = kq >= 2 ? _mm256_add_epi32(a[h][r], _mm256_madd_epi16(pairs, ones))
                                      : _mm256_add_epi16(a[h][r], pairs);
                }
            }
        for (int h = 0; h < 2; h++) {
            __m256 sg = group_scale8(s, g, kq, h);
            for (int r = 0; r < nt; r++) {
                __m256 dot = _mm256_cvtepi32_ps(kq >= 2 ? a[h][r] : _mm256_madd_epi16(a[h][r], ones));
                y[h][r] = _mm256_fmadd_ps(_mm256_mul_ps(sg, _mm256_set1_ps(d[(long)(t0 + r) * G + g])), dot, y[h][r]);
            }
            if (nt <= YM_FUSED_MAX) { /* few rows: the minimum term's chain in this loop, its zeros read once */
                __m256 mg = min_scale8(sg, s, z, kq, g, h);
                for (int r = 0; r < nt; r++)
                    ym[h][r] = _mm256_fmadd_ps(mg, _mm256_set1_ps(ds[(long)(t0 + r) * G + g]), ym[h][r]);
            }
        }
    }
    for (int g = 0; g < (nt <= YM_FUSED_MAX ? 0 : G); g++) /* more rows: the minimum term in a pass of its own */
        for (int h = 0; h < 2; h++) {
            __m256 mg = min_scale8(group_scale8(s, g, kq, h), s, z, kq, g, h);
            for (int r = 0; r < nt; r++)
                ym[h][r] = _mm256_fmadd_ps(mg, _mm256_set1_ps(ds[(long)(t0 + r) * G + g]), ym[h][r]);
        }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < nt; r++)
            _mm256_storeu_ps(acc_out + r * LANES + 8 * h, _mm256_add_ps(y[h][r], ym[h][r]));
}

/* block_int6 of the AVX-512 path (see there) for rows [t0, t0 + nt), nt <= ROWS4: per group and half of the block
   (8 lanes) its code vectors (low nibbles | high pairs << 4), each half-group's chain (instructions 0-3, 4-7) started
   at -32 sum_h(qx) and fed the s32 sums of VPMADDUBSW pairs (codes up to 63: two instructions' pair sums fit an s16
   lane, 2 x 2 x 63 x 127 = 32004), then the same float operations as there. Inlined with nt a constant. */
static inline __attribute__((always_inline)) void block_int6_n(const uint8_t *w, const uint16_t *s, int G,
                                                               const int8_t *qx, const float *d, const int32_t *h32,
                                                               int K, int t0, const int nt, float *acc_out) {
    const __m256i lo = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), pair = _mm256_set1_epi8(0x30);
    __m256 y[2][ROWS4];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < ROWS4; r++) y[h][r] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *wg = w + (long)g * WGROUP6;
#if PREFETCH
        for (int j = 0; j < 6; j++) _mm_prefetch((const char *)(wg + PREFETCH * 3 / 2 + 64 * j), _MM_HINT_T0);
#endif
        const uint8_t *sb = (const uint8_t *)s + (long)(g / KGROUPS) * KSUPER6;
        const uint8_t *sc = sb + 32 + 2 * LANES * (g % KGROUPS);
        __m256i a[2][ROWS4];
        __m256 part[2][ROWS4]; /* s0 x the first half-group's dot product, per row */
        _Pragma("GCC unroll 1") /* as block_int4_n */
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                __m256i p = _mm256_loadu_si256((const __m256i *)(wg + 64 * j + 32 * h));
                /* instructions 2j, 2j + 1: their high pairs in vector j / 2 at bits 2k, 2k + 1 (k = 2j % 4, then
                   k + 1), moved to bits 4, 5 */
                __m256i hp = _mm256_loadu_si256((const __m256i *)(wg + 256 + 64 * (j / 2) + 32 * h));
                if (j % 2 == 0) hp = _mm256_slli_epi16(hp, 4);
                __m256i u0 = _mm256_or_si256(_mm256_and_si256(p, lo), _mm256_and_si256(hp, pair));
                __m256i u1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), lo),
                                             _mm256_and_si256(_mm256_srli_epi16(hp, 2), pair));
                for (int r = 0; r < nt; r++) {
                    const int8_t *q = qx + (long)(t0 + r) * K + (long)g * GROUP + 8 * j;
                    if (j % 2 == 0) /* a half-group's chain starts at -32 sum_h(qx) */
                        a[h][r] = _mm256_set1_epi32(-h32[((long)(t0 + r) * G + g) * 2 + j / 2]);
                    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, bcast4(q)),
                                                     _mm256_maddubs_epi16(u1, bcast4(q + 4)));
                    a[h][r] = _mm256_add_epi32(a[h][r], _mm256_madd_epi16(pairs, ones));
                }
                if (j % 2 == 1) {
                    __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16 * h)));
                    __m128i c = _mm_loadl_epi64((const __m128i *)(sc + LANES * (j / 2) + 8 * h));
                    __m256 sh = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
                    for (int r = 0; r < nt; r++) {
                        __m256 dot = _mm256_cvtepi32_ps(a[h][r]);
                        if (j == 1)
                            part[h][r] = _mm256_mul_ps(sh, dot);
                        else
                            y[h][r] = _mm256_fmadd_ps(_mm256_set1_ps(d[(long)(t0 + r) * G + g]),
                                                      _mm256_fmadd_ps(sh, dot, part[h][r]), y[h][r]);
                    }
                }
            }
    }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < nt; r++) _mm256_storeu_ps(acc_out + r * LANES + 8 * h, y[h][r]);
}

/* block_int8 of the AVX-512 path for rows [t0, t0 + nt), nt <= ROWS8, with the integer dot product of the unsigned
   codes u = q + 128 taken as sum(q qx) + 128 sum(qx) (the codes' sum: quantize_rows): VPMADDUBSW multiplies the
   magnitudes |q| (u8, at most 128) by the activation codes with q's sign (VPSIGNB; at most 127 in magnitude), so each
   s16 pair sum is at most 2 x 128 x 127 = 32512, exact (llama.cpp's mul_sum_i8_pairs), and VPMADDWD by ones adds
   the pairs into s32. The same integer as VPDPBUSD's, so the same float operations follow. Against splitting each
   code into its nibbles (two VPMADDUBSW a vector, as int4) SmolLM2's 49152 x 576 head took 1.08-1.25x less time at
   T = 1-16 (docs/results/int8-sign-1206g.txt). Both halves in one pass and inlined with nt a constant, as
   block_int4_n. */
static inline __attribute__((always_inline)) void block_int8_n(const uint8_t *w, const uint16_t *s, int G,
                                                               const int8_t *qx, const float *d, const float *c,
                                                               const int32_t *sum, int K, int t0, const int nt,
                                                               float *acc_out) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 y[2][ROWS8];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < ROWS8; r++) y[h][r] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *wg = w + (long)g * 512;
#if PREFETCH
        for (int j = 0; j < 8; j++) _mm_prefetch((const char *)(wg + 2 * PREFETCH + 64 * j), _MM_HINT_T0);
#endif
        __m256i a[2][ROWS8];
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < ROWS8; r++) a[h][r] = _mm256_setzero_si256();
        _Pragma("GCC unroll 2") /* as block_int4_n; 1, 2 or 4 steps at a time measured the same, 8 slower */
        for (int i = 0; i < 8; i++)
            for (int h = 0; h < 2; h++) {
                __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wg + 64 * i + 32 * h)), flip);
                __m256i mag = _mm256_abs_epi8(q); /* -128 -> 128 as u8 */
                for (int r = 0; r < nt; r++) {
                    __m256i b = _mm256_sign_epi8(bcast4(qx + (long)(t0 + r) * K + (long)g * GROUP + 4 * i), q);
                    a[h][r] = _mm256_add_epi32(a[h][r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, b), ones));
                }
            }
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < nt; r++) {
                long at = (long)(t0 + r) * G + g;
                __m256i dot = _mm256_add_epi32(a[h][r], _mm256_set1_epi32(128 * sum[at]));
                y[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[at]), y[h][r]);
            }
    }
    for (int h = 0; h < 2; h++) {
        __m256 sr = load_bf16x8(s + 8 * h);
        for (int r = 0; r < nt; r++)
            _mm256_storeu_ps(acc_out + r * LANES + 8 * h,
                             _mm256_mul_ps(_mm256_sub_ps(y[h][r], _mm256_set1_ps(c[t0 + r])), sr));
    }
}

#endif

#if HAVE_KERNEL
/* One copy of block_int4_n / block_int8_n per row count 1..16 (those above ROWS4 / ROWS8 are never called) */
#define ROW_CASES(CALL) \
    switch (nt) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break; \
    case 9: CALL(9); break; case 10: CALL(10); break; case 11: CALL(11); break; case 12: CALL(12); break; \
    case 13: CALL(13); break; case 14: CALL(14); break; case 15: CALL(15); break; default: CALL(16); break; \
    }

static void block_int4(const uint8_t *w, const uint16_t *s, const uint16_t *z, int kq, int G, const int8_t *qx,
                       const float *d, const float *ds, int K, int t0, int nt, float *acc_out) {
#define CALL4(n) block_int4_n(w, s, z, 0, G, qx, d, ds, K, t0, (n) < ROWS4 ? (n) : ROWS4, acc_out)
#define CALL4K(n) block_int4_n(w, s, NULL, 1, G, qx, d, ds, K, t0, (n) < ROWS4 ? (n) : ROWS4, acc_out)
#define CALL5K(n) block_int4_n(w, s, NULL, 2, G, qx, d, ds, K, t0, (n) < ROWS4 ? (n) : ROWS4, acc_out)
#define CALL5(n) block_int4_n(w, s, z, 3, G, qx, d, ds, K, t0, (n) < ROWS4 ? (n) : ROWS4, acc_out)
    if (kq == 3)
        ROW_CASES(CALL5)
    else if (kq == 2)
        ROW_CASES(CALL5K)
    else if (kq)
        ROW_CASES(CALL4K)
    else
        ROW_CASES(CALL4)
#undef CALL4
#undef CALL4K
#undef CALL5K
#undef CALL5
}

static void block_int8(const uint8_t *w, const uint16_t *s, int G, const int8_t *qx, const float *d, const float *c,
                       const int32_t *sum, int K, int t0, int nt, float *acc_out) {
#define CALL8(n) block_int8_n(w, s, G, qx, d, c, sum, K, t0, (n) < ROWS8 ? (n) : ROWS8, acc_out)
    ROW_CASES(CALL8)
#undef CALL8
}

static void block_int6(const uint8_t *w, const uint16_t *s, int G, const int8_t *qx, const float *d,
                       const int32_t *h32, int K, int t0, int nt, float *acc_out) {
#define CALL6(n) block_int6_n(w, s, G, qx, d, h32, K, t0, (n) < ROWS4 ? (n) : ROWS4, acc_out)
    ROW_CASES(CALL6)
#undef CALL6
}

#endif

#if HAVE_AMX
/* The [nt, 16] integer dot products of m <= 4 consecutive groups into c [4][AMX_ROWS * 16]: qx at the first
   group's codes of row t0 (row stride K), b the groups' weight codes (512 bytes each, VNNI layout, stride bstep). */
static inline void amx_groups(const int8_t *qx, int K, const uint8_t *b, long bstep, int m, int32_t *c) {
    _tile_zero(0);
    _tile_loadd(4, qx, K);
    _tile_loadd(6, b, 64);
    _tile_dpbsud(0, 4, 6);
    if (m > 1) {
        _tile_zero(1);
        _tile_loadd(5, qx + GROUP, K);
        _tile_loadd(7, b + bstep, 64);
        _tile_dpbsud(1, 5, 7);
    }
    if (m > 2) {
        _tile_zero(2);
        _tile_loadd(4, qx + 2 * GROUP, K);
        _tile_loadd(6, b + 2 * bstep, 64);
        _tile_dpbsud(2, 4, 6);
    }
    if (m > 3) {
        _tile_zero(3);
        _tile_loadd(5, qx + 3 * GROUP, K);
        _tile_loadd(7, b + 3 * bstep, 64);
        _tile_dpbsud(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    if (m > 1) _tile_stored(1, c + AMX_ROWS * LANES, 64);
    if (m > 2) _tile_stored(2, c + 2 * AMX_ROWS * LANES, 64);
    if (m > 3) _tile_stored(3, c + 3 * AMX_ROWS * LANES, 64);
}

/* Pairs of groups, software-pipelined: pair p + 1's tile products (C tiles 0-1 or 2-3, alternately, into the other
   half of c) are issued before pair p's float rescaling, so the tile unit works while the vector units rescale. */
#define AMX_PAIR(C0, C1)                                                                                              \
    do {                                                                                                              \
        _tile_zero(C0);                                                                                               \
        _tile_loadd(4, qx, K);                                                                                        \
        _tile_loadd(6, b, 64);                                                                                        \
        _tile_dpbsud(C0, 4, 6);                                                                                       \
        if (m > 1) {                                                                                                  \
            _tile_zero(C1);                                                                                           \
            _tile_loadd(5, qx + GROUP, K);                                                                            \
            _tile_loadd(7, b + bstep, 64);                                                                            \
            _tile_dpbsud(C1, 5, 7);                                                                                   \
        }                                                                                                             \
        _tile_stored(C0, c, 64);                                                                                      \
        if (m > 1) _tile_stored(C1, c + AMX_ROWS * LANES, 64);                                                        \
    } while (0)

/* The [nt, 16] integer dot products of m <= 2 consecutive groups into c [2][AMX_ROWS * 16]: qx at the first group's
   codes of row t0 (row stride K), b the groups' weight codes (512 bytes each, VNNI layout, stride bstep). */
static inline void amx_pair(const int8_t *qx, int K, const uint8_t *b, long bstep, int m, int32_t *c, int odd) {
    if (odd)
        AMX_PAIR(2, 3);
    else
        AMX_PAIR(0, 1);
}

/* A pair's nibbles unpacked to bytes (8 rows of 64 per group), the layout AMX's B tile takes */
static inline void amx_unpack4(const uint8_t *w, int m, uint8_t *u) {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < m; j++) {
#if PREFETCH
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(w + 256 * j + PREFETCH + 64 * i), _MM_HINT_T0);
#endif
        for (int i = 0; i < 4; i++) {
            __m512i p = _mm512_loadu_si512((const void *)(w + 256 * j + 64 * i));
            _mm512_store_si512((void *)(u + 512 * j + 128 * i), _mm512_and_si512(p, lo));
            _mm512_store_si512((void *)(u + 512 * j + 128 * i + 64), _mm512_and_si512(_mm512_srli_epi16(p, 4), lo));
        }
    }
}

/* block_int4 for nt <= AMX_ROWS rows, the dot products from the tiles: the same float operations per row and group,
   in the same order (the minimum term in its own pass, as block_int4_n does above YM_FUSED_MAX rows). Inlined with
   nt a constant (AMX_CASES) so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_int4_amx_n(const uint8_t *w, const uint16_t *s,
                                                                   const uint16_t *z, const int kq, int G,
                                                                   const int8_t *qx,
                                                                   const float *d, const float *ds, int K, int t0,
                                                                   const int nt, float *acc_out) {
    __m512 y[AMX_ROWS];
    int32_t c[2][2 * AMX_ROWS * LANES] __attribute__((aligned(64)));
    uint8_t u[2][2 * 512] __attribute__((aligned(64)));
    for (int r = 0; r < AMX_ROWS; r++) y[r] = _mm512_setzero_ps();
    amx_configure(nt);
    const int8_t *q0 = qx + (long)t0 * K;
    int pairs = (G + 1) / 2;
    amx_unpack4(w, G < 2 ? G : 2, u[0]);
    amx_pair(q0, K, u[0], 512, G < 2 ? G : 2, c[0], 0);
    for (int p = 0; p < pairs; p++) {
        int g0 = 2 * p, m = G - g0 < 2 ? G - g0 : 2;
        if (p + 1 < pairs) {
            int g1 = g0 + 2, m1 = G - g1 < 2 ? G - g1 : 2;
            amx_unpack4(w + (long)g1 * 256, m1, u[(p + 1) & 1]);
            amx_pair(q0 + (long)g1 * GROUP, K, u[(p + 1) & 1], 512, m1, c[(p + 1) & 1], (p + 1) & 1);
        }
        for (int j = 0; j < m; j++) {
            int g = g0 + j;
            __m512 sg = kq ? kq_factor(s, g, 0) : load_bf16x16(s + (long)g * LANES);
            for (int r = 0; r < nt; r++) {
                __m512i a = _mm512_load_si512((const void *)(c[p & 1] + (j * AMX_ROWS + r) * LANES));
                long gi = (long)(t0 + r) * G + g;
                y[r] = _mm512_fmadd_ps(_mm512_mul_ps(sg, _mm512_set1_ps(d[gi])), _mm512_cvtepi32_ps(a), y[r]);
            }
        }
    }
    __m512 ym[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) ym[r] = _mm512_setzero_ps();
    min_term(s, z, kq, G, ds, t0, nt, ym);
    for (int r = 0; r < nt; r++) _mm512_storeu_ps(acc_out + r * LANES, _mm512_add_ps(y[r], ym[r]));
}

/* block_int8 for nt <= AMX_ROWS rows on tiles, four groups in flight (amx_groups: pipelining pairs as int4 does
   measured slower for int8, whose weights need no unpacking: 2048 x 2048 at T = 32 335 us against 271) */
static inline __attribute__((always_inline)) void block_int8_amx_n(const uint8_t *w, const uint16_t *s, int G,
                                                                   const int8_t *qx, const float *d, const float *cr,
                                                                   int K, int t0, const int nt, float *acc_out) {
    __m512 y[AMX_ROWS];
    int32_t c[4 * AMX_ROWS * LANES] __attribute__((aligned(64)));
    for (int r = 0; r < AMX_ROWS; r++) y[r] = _mm512_setzero_ps();
    amx_configure(nt);
    for (int g0 = 0; g0 < G; g0 += 4) {
        int m = G - g0 < 4 ? G - g0 : 4;
        const uint8_t *wg = w + (long)g0 * 512;
#if PREFETCH
        for (int i = 0; i < 32; i++) _mm_prefetch((const char *)(wg + 2 * PREFETCH + 64 * i), _MM_HINT_T0);
#endif
        amx_groups(qx + (long)t0 * K + (long)g0 * GROUP, K, wg, 512, m, c);
        for (int j = 0; j < m; j++)
            for (int r = 0; r < nt; r++) {
                __m512i a = _mm512_load_si512((const void *)(c + (j * AMX_ROWS + r) * LANES));
                y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(d[(long)(t0 + r) * G + g0 + j]), y[r]);
            }
    }
    __m512 sr = load_bf16x16(s);
    for (int r = 0; r < nt; r++)
        _mm512_storeu_ps(acc_out + r * LANES, _mm512_mul_ps(_mm512_sub_ps(y[r], _mm512_set1_ps(cr[t0 + r])), sr));
}

/* One copy per tile height AMX_MIN_ROWS..16 (rows below AMX_MIN_ROWS take the VNNI path) */
#define AMX_CASES(CALL)                                                                                               \
    switch (nt) {                                                                                                     \
    case 10: CALL(10); break; case 11: CALL(11); break; case 12: CALL(12); break; case 13: CALL(13); break;           \
    case 14: CALL(14); break; case 15: CALL(15); break; default: CALL(16); break;                                     \
    }

static void block_int4_amx(const uint8_t *w, const uint16_t *s, const uint16_t *z, int kq, int G, const int8_t *qx,
                           const float *d, const float *ds, int K, int t0, int nt, float *acc_out) {
#define CALLA4(n) block_int4_amx_n(w, s, z, 0, G, qx, d, ds, K, t0, n, acc_out)
#define CALLA4K(n) block_int4_amx_n(w, s, NULL, 1, G, qx, d, ds, K, t0, n, acc_out)
    if (kq)
        AMX_CASES(CALLA4K)
    else
        AMX_CASES(CALLA4)
#undef CALLA4
#undef CALLA4K
}

static void block_int8_amx(const uint8_t *w, const uint16_t *s, int G, const int8_t *qx, const float *d,
                           const float *cr, int K, int t0, int nt, float *acc_out) {
#define CALLA8(n) block_int8_amx_n(w, s, G, qx, d, cr, K, t0, n, acc_out)
    AMX_CASES(CALLA8)
#undef CALLA8
}
#endif

#if HAVE_AMX /* another library (oneDNN under PyTorch) may have loaded its own tile configuration since */
#define AMX_FRESH amx_rows = 0
#else
#define AMX_FRESH (void)0
#endif

#if HAVE_KERNEL

/* One block of 16 weight rows, all T rows of x: acc [T, 16]. */
static void block_all(const uint8_t *w, const uint16_t *s, const uint16_t *z, int bits, int G, long b,
                      const qrows *x, int K, int T, float *acc) {
    if (bits == STACK) { /* the part holding block b, and b within it */
        const int64_t *p = (const int64_t *)(const void *)s + 1;
        while (b >= p[0]) b -= p[0], p += 5;
        bits = (int)p[1], w = (const uint8_t *)(intptr_t)p[2], s = (const uint16_t *)(intptr_t)p[3];
        z = (const uint16_t *)(intptr_t)p[4];
    }
    const int8_t *qx = x->q;
    const float *d = x->d, *ds = x->ds, *c = x->c;
    int kq = bits == Q5 ? 3 : bits == Q5K ? 2 : bits == Q4K, int4 = bits == 4 || kq, int6 = bits == Q6K;
    /* bytes of codes per block of 16 rows */
    long wblock = (long)G * (kq >= 2 ? WGROUP5 : int4 ? 256 : int6 ? WGROUP6 : 512);
    /* int4 / Q6_K scales per block of 16 rows, in uint16 units: bf16 [G, 16] (Q5_0 / Q5_1: f16), Q4_K's KSUPER
       bytes a super-block, Q6_K's KSUPER6 */
    long sblock = kq == 1 || kq == 2 ? (long)G / KGROUPS * (KSUPER / 2)
                  : int6                 ? (long)G / KGROUPS * (KSUPER6 / 2)
                                         : (long)G * LANES;
#if HAVE_AMX
    int t_amx = 0; /* rows done on tiles of 16, then one of AMX_MIN_ROWS..15 rows; the rest below on VNNI (fewer rows
                      gain nothing from tiles: a 3072 x 576 int4 product at T = 2 took 41 us on tiles, 23 us on VNNI;
                      at 16 rows 83 against 108; docs/results/amx-matmul.txt) */
    if (amx_on && !int6 && kq < 2) /* (Q6_K's and 5-bit codes take the VNNI path at any row count) */
        while (T - t_amx >= AMX_MIN_ROWS || T - t_amx >= AMX_ROWS) {
            int nt = T - t_amx < AMX_ROWS ? T - t_amx : AMX_ROWS;
            if (int4)
                block_int4_amx(w + b * wblock, s + b * sblock, z ? z + b * G * LANES : NULL, kq, G, qx, d, ds, K,
                               t_amx, nt, acc + t_amx * LANES);
            else
                block_int8_amx(w + b * wblock, s + b * LANES, G, qx, d, c, K, t_amx, nt, acc + t_amx * LANES);
            t_amx += nt;
        }
#else
    int t_amx = 0;
#endif
    /* the rows left in passes of nearly equal size (16 rows at 5 a pass: 4, 4, 4, 4 rather than 5, 5, 5, 1: a pass
       over one row reads the block's weights for one row's work); a row's output does not depend on its pass */
    int rows = int4 || int6 ? ROWS4 : ROWS8, left = T - t_amx, passes = (left + rows - 1) / rows;
    for (int p = 0, t0 = t_amx; p < passes; p++) {
        int nt = left / passes + (p < left % passes);
        if (int6) {
            block_int6(w + b * wblock, s + b * sblock, G, qx, d, x->h32, K, t0, nt, acc + t0 * LANES);
            t0 += nt;
            continue;
        }
        if (int4)
            block_int4(w + b * wblock, s + b * sblock, z ? z + b * G * LANES : NULL, kq, G, qx, d, ds, K, t0, nt,
                       acc + t0 * LANES);
        else
            block_int8(w + b * wblock, s + b * LANES, G, qx, d, c, x->sum, K, t0, nt, acc + t0 * LANES);
        t0 += nt;
    }
}

/* Whether bits names a weight format the kernel takes for K inputs (Q4_K's scales come in super-blocks of 256) */
static int format_ok(int bits, int K) {
    return bits == 4 || bits == 8 || bits == Q5 ||
           ((bits == Q4K || bits == Q5K || bits == Q6K) && K % (KGROUPS * GROUP) == 0);
}

/* Whether s is a STACK table of parts in formats the kernel takes for K inputs, their blocks adding up to N rows */
static int stack_ok(const void *s, int K, int N) {
    const int64_t *t = (const int64_t *)s;
    long blocks = 0;
    for (int64_t i = 0; i < t[0]; i++) {
        const int64_t *p = t + 1 + 5 * i;
        if (p[0] < 1 || !format_ok((int)p[1], K)) return 0;
        blocks += p[0];
    }
    return t[0] > 0 && blocks * LANES == N;
}

static void qrows_free(qrows *o) { free(o->q), free(o->d), free(o->ds), free(o->c), free(o->sum); } /* h32: in sum's */

/* Buffers for T rows of K inputs (c zeroed, for its sums; qrows_free frees them); -1 when memory runs out (nothing left
   allocated). */
static int qrows_alloc(qrows *o, int T, int K) {
    size_t n = (size_t)T * (K / GROUP);
    *o = (qrows){malloc((size_t)T * K), malloc(n * sizeof(float)), malloc(n * sizeof(float)),
                 calloc((size_t)T, sizeof(float)), malloc(3 * n * sizeof(int32_t)), NULL};
    o->h32 = o->sum ? o->sum + n : NULL; /* one allocation for both: a matmul call is on every layer's path */
    if (o->q && o->d && o->ds && o->c && o->sum)
        return 0;
    qrows_free(o);
    *o = (qrows){0};
    return -1;
}

/* This thread's own buffers for T rows of K inputs, kept from call to call (grown when too small; up to ~0.1 MB for
   the few rows they serve), c zeroed; -1 when memory runs out. They are freed when the thread exits (a thread-specific
   key's destructor), so threads that come and go (a caller's short-lived threads, and the OpenMP team each of them
   gets) leave nothing behind. */
typedef struct {
    qrows rows;
    size_t elems, t; /* the capacity: T x K and T at the last allocation */
} own_buffers;
static __thread own_buffers *own;
static pthread_key_t own_key;
static pthread_once_t own_once = PTHREAD_ONCE_INIT;

static void own_release(void *p) {
    qrows_free(&((own_buffers *)p)->rows);
    free(p);
}

static void own_key_create(void) { pthread_key_create(&own_key, own_release); }

static int thread_rows(qrows *o, int T, int K) {
    if (!own) {
        pthread_once(&own_once, own_key_create);
        if (!(own = calloc(1, sizeof *own))) return -1;
        pthread_setspecific(own_key, own);
    }
    if ((size_t)T * K > own->elems || (size_t)T > own->t) {
        qrows_free(&own->rows);
        own->elems = own->t = 0;
        if (qrows_alloc(&own->rows, T, K)) return -1;
        own->elems = (size_t)T * K, own->t = (size_t)T;
    }
    *o = own->rows;
    memset(o->c, 0, sizeof(float) * (size_t)T);
    return 0;
}

/* The T activation rows quantized (quantize_rows) into new buffers (the caller frees them: qrows_free); -1 when
   memory runs out. */
static int quantized_input(const void *x, int bf16, int T, int K, const float *norm, float eps, qrows *o) {
    if (qrows_alloc(o, T, K))
        return -1;
    quantize_rows(x, bf16, 0, T, K, norm, eps, o);
    return 0;
}

#endif

/* y = x [T, K] W^T, W [N, K]. bits: 4, 8, Q4K, Q5K, Q6K, Q5 or STACK. w: packed codes (see the header), s / z: bf16
   scales / zeros laid out [N/16, K/32, 16] (int4; z NULL: every zero is 0, symmetric weights; Q5: f16 d / m, z NULL
   for Q5_0), s [N] (int8, z unused), or s Q4_K's scales [N/16, K/256, KSUPER bytes] (Q4K, Q5K, z unused) or Q6_K's
   [N/16, K/256, KSUPER6 bytes] (Q6K, z unused) or a STACK table (see the header). x, y
   and residual are bf16 when bf16 is 1, f32 when 0; bf16 = WIDEN: x and residual bf16, y f32 holding the
   bf16-rounded values (what widening a bf16 result gives, written in one pass: an output head's logits).
   norm: f32 [K] RMSNorm weight applied to x's rows first (eps inside the root), or NULL. swiglu 1: y [T, N/2] =
   silu(x Wg^T) * (x Wu^T) with Wg, Wu the first and second N/2 rows; 2: GELU (tanh) in place of silu.
   residual: y = residual + x W^T, or NULL.
   Returns 0, -1 when out of memory, -2 when the shapes are not multiples of 16 rows / 32 inputs (32 rows with
   swiglu) or the kernel is not built for this CPU. */
int specdec_matmul(const void *x, int T, int K, int N, int bits, const uint8_t *w, const uint16_t *s,
                   const uint16_t *z, void *y, int bf16, const float *norm, float eps, int swiglu,
                   const void *residual) {
#if HAVE_KERNEL
    if (K % GROUP || N % (swiglu ? 2 * LANES : LANES) || T < 1) return -2;
    if (bits == STACK ? !stack_ok(s, K, N) : !format_ok(bits, K)) return -2;
    int G = K / GROUP, blocks = N / LANES, n_out = swiglu ? N / 2 : N, mine = T <= OWN_ROWS;
    qrows in = {0};
    if (!mine && qrows_alloc(&in, T, K)) return -1;
    int failed = 0;
    _Pragma("omp parallel reduction(| : failed)") {
        AMX_FRESH;
        qrows rows = in;
        if (mine) { /* a decode step's few rows: each thread quantizes them itself into its own buffers, so no thread
                      waits for another before its blocks (a row's codes are the same operations wherever computed) */
            if (thread_rows(&rows, T, K))
                failed = 1;
            else
                quantize_rows(x, bf16, 0, T, K, norm, eps, &rows);
        } else { /* the rows shared out between the threads */
            _Pragma("omp for schedule(static)") for (int t = 0; t < T; t++)
                quantize_rows(x, bf16, t, t + 1, K, norm, eps, &in);
        }
        float few[OWN_ROWS * LANES * 2], *acc = mine ? few : malloc(sizeof(float) * (size_t)T * LANES * 2);
        /* nowait: the region's end is the one barrier the blocks need (before it, each thread only frees its acc);
           one barrier less a call: SmolLM2 decode 1.02x (docs/results/own-rows-1207d.txt) */
        if (!acc) failed = 1;
        _Pragma("omp for schedule(static) nowait") for (int b = 0; b < (swiglu ? blocks / 2 : blocks); b++) {
            if (!acc || (mine && !rows.q)) continue;
            block_all(w, s, z, bits, G, b, &rows, K, T, acc);
            if (swiglu) block_all(w, s, z, bits, G, b + blocks / 2, &rows, K, T, acc + T * LANES);
            for (int t = 0; t < T; t++)
                out16(acc + t * LANES, swiglu ? acc + (T + t) * LANES : NULL, swiglu == 2, residual, y, bf16,
                      (long)t * n_out + (long)b * LANES);
        }
        if (!mine) free(acc);
    }
    if (!mine) qrows_free(&in);
    return failed ? -1 : 0;
#else
    (void)x, (void)T, (void)K, (void)N, (void)bits, (void)w, (void)s, (void)z, (void)y, (void)bf16, (void)norm;
    (void)eps, (void)swiglu, (void)residual;
    return -2;
#endif
}

/* Rows ids[0 .. n) of an int8 weight packed as specdec_matmul takes it (codes q + 128 [N/16, K/32, 8, 64], s: bf16
   scale per row), as the activations an embedding lookup makes of them: out [n, K] = (q - 128) s, rounded to bf16
   when bf16, then times mul, rounded again, when mul != 1 (Gemma's embedding scale): the operations of the PyTorch
   path (quant.Int8Linear.rows, then the model's dtype and scale) in the same order, one call instead of ~8 small
   ops that cost a SmolLM2 decode step 0.17 ms (each op's code cold after the layers stream the weights;
   docs/results/step-glue-1206.txt). Plain C: it needs no vector unit. Returns 0, or -1 (nothing written) when an id
   is not one of the N rows. */
static inline float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u; /* round to nearest even, as torch (no NaN here) */
    memcpy(&f, &u, sizeof f);
    return f;
}

int specdec_rows_int8(const uint8_t *w, const uint16_t *s, int N, int K, const int64_t *ids, int n, void *out,
                      int bf16, float mul) {
    int G = K / GROUP;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    for (int i = 0; i < n; i++) {
        long id = (long)ids[i], lane = id % LANES;
        uint32_t su = (uint32_t)s[id] << 16;
        float sc;
        memcpy(&sc, &su, sizeof sc);
        const uint8_t *block = w + id / LANES * (long)G * 512;
        for (int k = 0; k < K; k++) {
            float v = (float)((int)block[(long)(k / GROUP) * 512 + (k % GROUP) / 4 * 64 + lane * 4 + k % 4] - 128) * sc;
            if (bf16) v = bf16_round(v);
            if (mul != 1.0f) v = bf16 ? bf16_round(v * mul) : v * mul;
            if (bf16) {
                uint32_t u;
                memcpy(&u, &v, sizeof u);
                ((uint16_t *)out)[(long)i * K + k] = (uint16_t)(u >> 16);
            } else {
                ((float *)out)[(long)i * K + k] = v;
            }
        }
    }
    return 0;
}

/* H independent products y_h = x_h W_h^T, h = 0..H-1 (multi-head latent attention's absorbed per-head matrices,
   models/mla.py): x [H, T, K] head-major and contiguous, W_h [N, K] packed as specdec_matmul takes it, its codes /
   scales / zeros at w[h], s[h], z[h] (z[h] NULL: symmetric), y [H, T, N]. One call instead of H: the H T activation
   rows are quantized in one pass and OpenMP splits the (head, block of 16 outputs) pairs. Each output is computed
   by the instructions specdec_matmul uses for it, whatever T and H: batch-invariant. Returns as specdec_matmul. */
int specdec_matmul_heads(const void *x, int H, int T, int K, int N, int bits, const uint8_t *const *w,
                         const uint16_t *const *s, const uint16_t *const *z, void *y, int bf16) {
#if HAVE_KERNEL
    if (K % GROUP || N % LANES || !format_ok(bits, K) || T < 1 || H < 1) return -2;
    int G = K / GROUP, blocks = N / LANES;
    qrows in;
    if (quantized_input(x, bf16, H * T, K, NULL, 0.0f, &in)) return -1;
    int failed = 0;
    _Pragma("omp parallel reduction(| : failed)") {
        AMX_FRESH;
        float *acc = malloc(sizeof(float) * (size_t)T * LANES);
        if (!acc) failed = 1;
        _Pragma("omp for schedule(static) nowait") for (long i = 0; i < (long)H * blocks; i++) {
            if (!acc) continue;
            long h = i / blocks, b = i % blocks, r0 = h * (long)T;
            qrows rows = qrows_at(&in, r0, G, K);
            block_all(w[h], s[h], z[h], bits, G, b, &rows, K, T, acc);
            for (int t = 0; t < T; t++)
                out16(acc + t * LANES, NULL, 0, NULL, y, bf16, (r0 + t) * N + b * LANES);
        }
        free(acc);
    }
    qrows_free(&in);
    return failed ? -1 : 0;
#else
    (void)x, (void)H, (void)T, (void)K, (void)N, (void)bits, (void)w, (void)s, (void)z, (void)y, (void)bf16;
    return -2;
#endif
}

/* A mixture-of-experts layer's routed experts over R rows in one call (models/moe.py): out[r k + j] =
   W2_e (silu(Wg_e x_r) * (Wu_e x_r)), e = ids[r k + j], for each row's k chosen experts. w13 [E][3] / w2 [E][3]:
   each expert's packed gate-then-up [2 I, D] and down [D, I] layers (codes, scales, zeros or 0; bits13 / bits2
   bits). The rows are quantized once; the slots are grouped by expert (ascending, rows in order within one), each
   chosen expert's two products run over its rows only (experts no row chose are never read), and OpenMP splits the
   (expert, block of 16 outputs) pairs of both phases. Every output row is computed by the instructions
   specdec_matmul uses for that row alone (its swiglu call, then the down projection of the stored bf16 / f32
   product), whatever the other rows chose: batch-invariant. out: [R k, D]. Returns as specdec_matmul. */
int specdec_experts(const void *x, int R, int D, int k, const int64_t *ids, int E, int I, int bits13, int bits2,
                    const int64_t *w13, const int64_t *w2, void *out, int bf16) {
#if HAVE_KERNEL
    if (D % GROUP || I % GROUP || I % LANES || D % LANES || !format_ok(bits13, D) || !format_ok(bits2, I) || R < 1 ||
        k < 1)
        return -2;
    int n = R * k, G1 = D / GROUP, G2 = I / GROUP, esize = bf16 ? 2 : 4;
    int *count = calloc((size_t)E + 1, sizeof(int)), *order = malloc(sizeof(int) * (size_t)n);
    int *first = malloc(sizeof(int) * ((size_t)E + 1)), *used = malloc(sizeof(int) * ((size_t)E + 1));
    qrows in = {0}, srt = {0}, act = {0}; /* the rows; each slot's row, by expert; the products, by expert */
    char *a = malloc((size_t)n * I * esize);
    int failed = !count || !order || !first || !used || !a || qrows_alloc(&srt, n, D);
    for (int s = 0; s < n && !failed; s++)
        failed = ids[s] < 0 || ids[s] >= E;
    if (failed || quantized_input(x, bf16, R, D, NULL, 0.0f, &in)) {
        int shapes = failed == 1 && count && order && first && used && a && srt.q;
        free(count), free(order), free(first), free(used), free(a), qrows_free(&srt);
        return shapes ? -2 : -1;
    }
    /* slots by expert (a counting sort: stable, so rows stay in order within an expert), and the experts used */
    for (int s = 0; s < n; s++)
        count[ids[s] + 1]++;
    int nused = 0;
    for (int e = 0; e < E; e++) {
        first[e] = count[e];
        count[e + 1] += count[e];
        if (count[e + 1] > count[e])
            used[nused++] = e;
    }
    first[E] = n;
    for (int s = 0; s < n; s++)
        order[count[ids[s]]++] = s; /* count[e] ends at first[e + 1] */
    for (int i = 0; i < n; i++) { /* the slots' quantized rows, in sorted order */
        int r = order[i] / k;
        memcpy(srt.q + (long)i * D, in.q + (long)r * D, D);
        memcpy(srt.d + (long)i * G1, in.d + (long)r * G1, sizeof(float) * G1);
        memcpy(srt.ds + (long)i * G1, in.ds + (long)r * G1, sizeof(float) * G1);
        memcpy(srt.sum + (long)i * G1, in.sum + (long)r * G1, sizeof(int32_t) * G1);
        memcpy(srt.h32 + (long)i * G1 * 2, in.h32 + (long)r * G1 * 2, sizeof(int32_t) * G1 * 2);
        srt.c[i] = in.c[r];
    }
    qrows_free(&in);
    int half = I / LANES; /* blocks of the gate half (the up half's block b + half pairs with gate block b) */
    _Pragma("omp parallel reduction(| : failed)") {
        AMX_FRESH;
        int most = 0;
        for (int u = 0; u < nused; u++)
            most = first[used[u] + 1] - first[used[u]] > most ? first[used[u] + 1] - first[used[u]] : most;
        float *acc = malloc(sizeof(float) * (size_t)most * LANES * 2);
        if (!acc) failed = 1;
        _Pragma("omp for schedule(static) nowait") for (long i = 0; i < (long)nused * half; i++) {
            if (!acc) continue;
            int e = used[i / half], b = (int)(i % half), s0 = first[e], T = first[e + 1] - s0;
            const int64_t *p = w13 + 3L * e;
            const uint8_t *w = (const uint8_t *)p[0];
            const uint16_t *s = (const uint16_t *)p[1], *z = (const uint16_t *)p[2];
            qrows rows = qrows_at(&srt, s0, G1, D);
            block_all(w, s, z, bits13, G1, b, &rows, D, T, acc);
            block_all(w, s, z, bits13, G1, b + half, &rows, D, T, acc + T * LANES);
            for (int t = 0; t < T; t++)
                out16(acc + t * LANES, acc + (T + t) * LANES, 0, NULL, a, bf16, (long)(s0 + t) * I + (long)b * LANES);
        }
        free(acc);
    }
    if (!failed && quantized_input(a, bf16, n, I, NULL, 0.0f, &act))
        failed = 1;
    int blocks2 = D / LANES;
    if (!failed) {
        _Pragma("omp parallel reduction(| : failed)") {
        AMX_FRESH;
            int most = 0;
            for (int u = 0; u < nused; u++)
                most = first[used[u] + 1] - first[used[u]] > most ? first[used[u] + 1] - first[used[u]] : most;
            float *acc = malloc(sizeof(float) * (size_t)most * LANES);
            if (!acc) failed = 1;
            _Pragma("omp for schedule(static) nowait") for (long i = 0; i < (long)nused * blocks2; i++) {
                if (!acc) continue;
                int e = used[i / blocks2], b = (int)(i % blocks2), s0 = first[e], T = first[e + 1] - s0;
                const int64_t *p = w2 + 3L * e;
                qrows rows = qrows_at(&act, s0, G2, I);
                block_all((const uint8_t *)p[0], (const uint16_t *)p[1], (const uint16_t *)p[2], bits2, G2, b, &rows,
                          I, T, acc);
                for (int t = 0; t < T; t++)
                    out16(acc + t * LANES, NULL, 0, NULL, out, bf16, (long)order[s0 + t] * D + (long)b * LANES);
            }
            free(acc);
        }
    }
    qrows_free(&act), qrows_free(&srt);
    free(count), free(order), free(first), free(used), free(a);
    return failed ? -1 : 0;
#else
    (void)x, (void)R, (void)D, (void)k, (void)ids, (void)E, (void)I, (void)bits13, (void)bits2, (void)w13, (void)w2;
    (void)out, (void)bf16;
    return -2;
#endif
}

/* The machine's peak rate of the instruction the kernel's integer dot products run on (which = 0: VPDPBUSD zmm on
   the AVX-512 VNNI path, 64 u8 x s8 products each; VPMADDUBSW ymm on the AVX2 path, 32) or of f32 fused
   multiply-adds at the path's width (which = 1: zmm, 16 each; ymm, 8), for the roofline to set the
   kernels' measured rates against (AMX's tile passes, where the CPU has them, are not covered): 12 independent chains
   a thread, so the instruction's throughput, not its latency, sets the pace, every OpenMP thread at once, `iters`
   rounds each. Returns multiply-adds per second over all threads; -1 where this build has no kernel path. */
static volatile int64_t peak_sink;

#define PEAK_CHAINS 12
#if HAVE_VNNI
typedef __m512i peak_vi;
typedef __m512 peak_vf;
#define PEAK_INT_MACS 64
#define PEAK_FMA_MACS 16
#define PEAK_INT(a, u, v) _mm512_dpbusd_epi32(a, u, v)
#define PEAK_SETI(x) _mm512_set1_epi32(x)
#define PEAK_SETB(x) _mm512_set1_epi8(x)
#define PEAK_SETF(x) _mm512_set1_ps(x)
#define PEAK_FMA(a, x, y) _mm512_fmadd_ps(a, x, y)
#define PEAK_SUMI(a) _mm512_reduce_add_epi32(a)
#define PEAK_SUMF(a) _mm512_reduce_add_ps(a)
#elif HAVE_AVX2
typedef __m256i peak_vi;
typedef __m256 peak_vf;
#define PEAK_INT_MACS 32
#define PEAK_FMA_MACS 8
#define PEAK_INT(a, u, v) _mm256_maddubs_epi16(_mm256_xor_si256(a, u), v) /* a chain through the u8 operand */
#define PEAK_SETI(x) _mm256_set1_epi32(x)
#define PEAK_SETB(x) _mm256_set1_epi8(x)
#define PEAK_SETF(x) _mm256_set1_ps(x)
#define PEAK_FMA(a, x, y) _mm256_fmadd_ps(a, x, y)
#define PEAK_SUMI(a) _mm256_extract_epi32(a, 0)
#define PEAK_SUMF(a) _mm256_cvtss_f32(a)
#endif

#if HAVE_KERNEL
static int64_t peak_int_chains(long iters) {
    peak_vi a[PEAK_CHAINS], v[PEAK_CHAINS], u = PEAK_SETB(3);
    for (int j = 0; j < PEAK_CHAINS; j++) a[j] = PEAK_SETI(j), v[j] = PEAK_SETB((char)(j + 1));
    for (long n = 0; n < iters; n++) {
#pragma GCC unroll 12
        for (int j = 0; j < PEAK_CHAINS; j++) a[j] = PEAK_INT(a[j], u, v[j]);
        __asm__ volatile("" : "+x"(u)); /* u unknown each round: no chain is folded or hoisted */
    }
    int64_t s = 0;
    for (int j = 0; j < PEAK_CHAINS; j++) s += PEAK_SUMI(a[j]);
    return s;
}

static int64_t peak_fma_chains(long iters) {
    peak_vf a[PEAK_CHAINS], y[PEAK_CHAINS], x = PEAK_SETF(0.999f);
    for (int j = 0; j < PEAK_CHAINS; j++) a[j] = PEAK_SETF((float)j), y[j] = PEAK_SETF(0.5f + 1e-3f * (float)j);
    for (long n = 0; n < iters; n++) {
#pragma GCC unroll 12
        for (int j = 0; j < PEAK_CHAINS; j++) a[j] = PEAK_FMA(a[j], x, y[j]);
        __asm__ volatile("" : "+x"(x));
    }
    float s = 0.0f;
    for (int j = 0; j < PEAK_CHAINS; j++) s += PEAK_SUMF(a[j]);
    return (int64_t)s;
}
#endif

double specdec_peak(int which, long iters) {
#if HAVE_KERNEL
    struct timespec t0, t1;
    int threads = 0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
#pragma omp parallel
    {
        __atomic_add_fetch(&threads, 1, __ATOMIC_RELAXED);
        int64_t s = which ? peak_fma_chains(iters) : peak_int_chains(iters);
        __atomic_add_fetch(&peak_sink, s, __ATOMIC_RELAXED);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    double macs = (double)threads * (double)iters * PEAK_CHAINS * (which ? PEAK_FMA_MACS : PEAK_INT_MACS);
    return seconds > 0.0 ? macs / seconds : -1.0;
#else
    (void)which, (void)iters;
    return -1.0;
#endif
}
