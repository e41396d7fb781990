/* Sampling kernels (sampling.py): the top-n selection, and the whole sampler of one row of logits.

   specdec_topk: the n largest values of each row of a float32 matrix, with their indices (torch.topk over a
   49152-token vocabulary costs 70-170 us per row on this CPU). One pass per row: a min-heap of the n best so far; 16 values at a time are compared with the heap's minimum
   (AVX-512 where the compiler targets it, else plain loops vectorized by the compiler) and only those above it are
   inserted, which after the first few thousand values is rare. Output sorted by value, descending; equal values in
   no particular order (callers rank ties themselves). NaN compares false everywhere and is never selected. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline void sift_down(float *hv, int32_t *hi, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && hv[l] < hv[m]) m = l;
        if (r < n && hv[r] < hv[m]) m = r;
        if (m == i) return;
        float tv = hv[i];
        int32_t ti = hi[i];
        hv[i] = hv[m], hi[i] = hi[m], hv[m] = tv, hi[m] = ti;
        i = m;
    }
}

/* The n largest of row[0 .. V) (1 <= n <= V), sorted descending, into ov / oi; hv / hi: scratch of n. Returns
   how many were found (< n only when the row holds NaN). */
static int top_row(const float *row, long V, int n, float *hv, int32_t *hi, float *ov, int64_t *oi) {
    int size = 0;
    long j = 0;
    for (; j < V && size < n; j++) { /* fill the heap, NaN skipped */
        float v = row[j];
        if (v != v) continue;
        int i = size++;
        hv[i] = v, hi[i] = (int32_t)j;
        while (i > 0 && hv[(i - 1) / 2] > hv[i]) { /* sift up */
            int p = (i - 1) / 2;
            float tv = hv[p];
            int32_t ti = hi[p];
            hv[p] = hv[i], hi[p] = hi[i], hv[i] = tv, hi[i] = ti;
            i = p;
        }
    }
    for (; j < V; j += 16) {
        long end = j + 16 < V ? j + 16 : V;
        float lo = hv[0];
        int any = 0;
#if defined(__AVX2__)
        if (end - j == 16) { /* one compare per 8 values (NaN compares false, as below) */
            __m256 l8 = _mm256_set1_ps(lo);
            any = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), l8, _CMP_GT_OQ),
                                                  _mm256_cmp_ps(_mm256_loadu_ps(row + j + 8), l8, _CMP_GT_OQ)));
        } else
#endif
            for (long t = j; t < end; t++) any |= row[t] > lo;
        if (!any) continue;
        for (long t = j; t < end; t++)
            if (row[t] > hv[0]) {
                hv[0] = row[t], hi[0] = (int32_t)t;
                sift_down(hv, hi, size, 0);
            }
    }
    /* heap -> descending order: pop the minimum into the last free slot */
    int found = size;
    for (int k = size - 1; k >= 0; k--) {
        ov[k] = hv[0], oi[k] = hi[0];
        hv[0] = hv[k], hi[0] = hi[k];
        sift_down(hv, hi, k, 0);
    }
    return found;
}

/* x: [rows, V] f32 (row stride `stride` floats); out_v / out_i: [rows, n]. Requires 1 <= n <= V. Returns 0, or -1
   when out of memory. */
int specdec_topk(const float *x, long rows, long V, long stride, int n, float *out_v, int64_t *out_i) {
    float *hv = malloc(sizeof(float) * (size_t)n);
    int32_t *hi = malloc(sizeof(int32_t) * (size_t)n);
    if (!hv || !hi) {
        free(hv), free(hi);
        return -1;
    }
    for (long r = 0; r < rows; r++) {
        float *ov = out_v + r * n;
        int64_t *oi = out_i + r * n;
        int size = top_row(x + r * stride, V, n, hv, hi, ov, oi);
        for (int k = size; k < n; k++) ov[k] = -__builtin_inff(), oi[k] = 0; /* rows of NaN only */
    }
    free(hv), free(hi);
    return 0;
}

/* ---- the sampler of one row ------------------------------------------------------------------------------------ */

#define TIE_SLACK 16   /* candidates taken past the k-th, so a run of values tied with it is usually inside */
#define PARTIAL_START 64 /* candidates first tried for top-p / min-p without top-k, times 4 while needed */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include "vexp.h"
#endif

/* max over a row, NaN skipped (-inf when nothing else). With AVX2, 32 lanes: MAXPS returns its second operand when
   the first is NaN, so max(v, m) skips NaN as the scalar test does; the max of a set does not depend on the order it
   is taken in (only a zero's sign could, and x - m is then the same). GCC does not vectorize the scalar loop (no
   -ffast-math); with this and the 8-wide block test in top_row a CLI-defaults draw on 49152 tokens took 70 -> 33 us
   (docs/results/sampler-ab.txt). */
static float row_max(const float *x, long V) {
    float m = -__builtin_inff();
    long j = 0;
#if defined(__AVX2__)
    if (V >= 32) {
        __m256 a[4];
        for (int i = 0; i < 4; i++) a[i] = _mm256_set1_ps(m);
        for (; j + 32 <= V; j += 32)
            for (int i = 0; i < 4; i++) a[i] = _mm256_max_ps(_mm256_loadu_ps(x + j + 8 * i), a[i]);
        __m256 b = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        float l[8];
        _mm256_storeu_ps(l, b);
        for (int i = 0; i < 8; i++)
            if (l[i] > m) m = l[i];
    }
#endif
    for (; j < V; j++)
        if (x[j] > m) m = x[j];
    return m;
}

/* e[0 .. end - j) = exp((x[j ..] - m) / t) for one block of at most 16 values (0 for NaN and for arguments below
   -87, i.e. weights below 1e-38 of the top one), and their sum in double. The one definition of a token's weight on
   the dense path: both passes of inverse CDF call it, so the totals they see agree bitwise. */
static double block_exp(const float *x, long j, long end, float m, float inv_t, float *e) {
#if defined(__AVX512F__)
    __mmask16 in = (__mmask16)((1u << (end - j)) - 1u);
    __m512 v = _mm512_maskz_loadu_ps(in, x + j);
    __m512 a = _mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(m)), _mm512_set1_ps(inv_t));
    __mmask16 ok = _mm512_mask_cmp_ps_mask(in, a, _mm512_set1_ps(-87.0f), _CMP_GE_OQ); /* NaN compares false */
    __m512 w = _mm512_maskz_mov_ps(ok, exp_nonpos(a));
    _mm512_storeu_ps(e, w);
    return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(w)),
                                              _mm512_cvtps_pd(_mm512_extractf32x8_ps(w, 1))));
#elif defined(__AVX2__) && defined(__FMA__)
    /* the same weights and sum, 8 lanes at a time (the sum in _mm512_reduce_add_pd's order) */
    __m256 w[2];
    for (int h = 0; h < 2; h++) {
        long n = end - j - 8 * h;
        __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(n < 0 ? 0 : (int)n),
                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 v = _mm256_maskload_ps(x + j + 8 * h, in);
        __m256 a = _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(m)), _mm256_set1_ps(inv_t));
        __m256 ok = _mm256_and_ps(_mm256_castsi256_ps(in), _mm256_cmp_ps(a, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
        w[h] = _mm256_and_ps(ok, exp_nonpos8(a));
        _mm256_storeu_ps(e + 8 * h, w[h]);
    }
    __m256d lo = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(w[0])),
                               _mm256_cvtps_pd(_mm256_castps256_ps128(w[1])));
    __m256d hi = _mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(w[0], 1)),
                               _mm256_cvtps_pd(_mm256_extractf128_ps(w[1], 1)));
    __m256d t3 = _mm256_add_pd(hi, lo);
    __m128d t6 = _mm_add_pd(_mm256_extractf128_pd(t3, 1), _mm256_castpd256_pd128(t3));
    return _mm_cvtsd_f64(t6) + _mm_cvtsd_f64(_mm_unpackhi_pd(t6, t6));
#else
    double s = 0.0;
    for (long i = j; i < end; i++) {
        float a = (x[i] - m) * inv_t;
        e[i - j] = a >= -87.0f ? expf(a) : 0.0f;
        s += e[i - j];
    }
    for (long i = end - j; i < 16; i++) e[i] = 0.0f;
    return s;
#endif
}

/* the dense path: inverse CDF over the whole row at temperature t, in vocabulary order. The first pass keeps each
   block's sum, so the second adds the same sums in the same order and computes weights only in the block the target
   falls in: the same token with half the exps (the temperature-only draw on 49152 tokens 119 -> 65 us,
   docs/results/sampler-ab.txt). -2: out of memory. */
static long sample_dense(const float *x, long V, float m, float inv_t, double u) {
    float e[16];
    long nb = (V + 15) / 16;
    double z = 0.0, *sums = malloc(sizeof(double) * (size_t)nb);
    if (!sums) return -2;
    for (long b = 0; b < nb; b++) z += sums[b] = block_exp(x, 16 * b, 16 * b + 16 < V ? 16 * b + 16 : V, m, inv_t, e);
    if (!(z > 0.0)) {
        free(sums);
        return -1;
    }
    double target = u * z, cum = 0.0;
    long last = -1, lastb = -1; /* the last token with weight, once known; else the last block with weight */
    for (long b = 0; b < nb; b++) {
        long j = 16 * b, end = j + 16 < V ? j + 16 : V;
        double s = sums[b];
        if (cum + s > target) { /* inside this block: walk it */
            block_exp(x, j, end, m, inv_t, e);
            free(sums);
            double c = cum;
            for (long i = j; i < end; i++) {
                if (e[i - j] <= 0.0f) continue;
                c += e[i - j];
                last = i;
                if (c > target) return i;
            }
            return last; /* the walk's rounding fell short of the block's sum: its last token with weight */
        }
        cum += s;
        if (s > 0.0) lastb = b;
    }
    free(sums);
    if (lastb >= 0) { /* rounding kept the target out of every block: the last token with weight */
        long j = 16 * lastb, end = j + 16 < V ? j + 16 : V;
        block_exp(x, j, end, m, inv_t, e);
        for (long i = end - 1; i >= j; i--)
            if (e[i - j] > 0.0f) return i;
    }
    return last;
}

/* rank equal values by id descending (the reverse of a stable ascending sort, as the dense reference ranks them) */
static int id_descending(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x < y) - (x > y);
}

static void rank_ties(float *cv, int64_t *ci, int n) {
    for (int a = 0; a < n;) {
        int b = a + 1;
        while (b < n && cv[b] == cv[a]) b++;
        if (b - a > 16) /* a long run: an insertion sort is quadratic (a row of 49152 equal logits took 10 s) */
            qsort(ci + a, (size_t)(b - a), sizeof(int64_t), id_descending);
        else
            for (int i = a + 1; i < b; i++) /* insertion sort of the run by id, descending */
                for (int j = i; j > a && ci[j] > ci[j - 1]; j--) {
                    int64_t t = ci[j];
                    ci[j] = ci[j - 1], ci[j - 1] = t;
                }
        a = b;
    }
}

static long count_at_least(const float *x, long V, float v) {
    long c = 0;
    for (long j = 0; j < V; j++) c += x[j] >= v;
    return c;
}

#define RANK_ALL_FROM 4096 /* candidate sets this large come from rank_all instead of top_row's heap */

/* Every non-NaN value of x [V] in the order top_row and rank_ties leave a selection in (value descending, equal
   values by id descending): an LSD radix sort, 4 passes of 8 bits, of the values' order-preserving bit patterns
   (+0 and -0 one key, as they compare equal), fed in id-descending order so the stable passes keep ties that way.
   O(V) where top_row's heap of n costs O(V log n) and thousands of insertions: a draw at temperature 1.5 with
   top-p 0.95 and no top-k on 49152 random logits 12.3 -> 2.5 ms (docs/results/sampler-ab.txt).
   -> how many values (-1: out of memory). */
static long rank_all(const float *x, long V, float *ov, int64_t *oi) {
    uint32_t *ka = malloc(sizeof(uint32_t) * V), *kb = malloc(sizeof(uint32_t) * V);
    int32_t *ia = malloc(sizeof(int32_t) * V), *ib = malloc(sizeof(int32_t) * V);
    long n = -1;
    if (!ka || !kb || !ia || !ib) goto out;
    n = 0;
    for (long j = V - 1; j >= 0; j--) {
        float v = x[j];
        if (v != v) continue;
        uint32_t b;
        memcpy(&b, &v, sizeof b);
        if (v == 0.0f) b = 0;                                     /* -0 ranks with +0 */
        ka[n] = ~((b & 0x80000000u) ? ~b : (b | 0x80000000u)); /* ascending key of the value, inverted */
        ia[n++] = (int32_t)j;
    }
    for (int shift = 0; shift < 32; shift += 8) {
        long start[257] = {0};
        for (long i = 0; i < n; i++) start[((ka[i] >> shift) & 255u) + 1]++;
        for (int d = 0; d < 256; d++) start[d + 1] += start[d];
        for (long i = 0; i < n; i++) {
            long at = start[(ka[i] >> shift) & 255u]++;
            kb[at] = ka[i], ib[at] = ia[i];
        }
        uint32_t *tk = ka;
        int32_t *ti = ia;
        ka = kb, kb = tk, ia = ib, ib = ti;
    }
    for (long i = 0; i < n; i++) ov[i] = x[ia[i]], oi[i] = ia[i];
out:
    free(ka), free(kb), free(ia), free(ib);
    return n;
}

/* One token drawn from the processed distribution of a row of logits x [V]: temperature t, then top-k (k <= 0 or
   k >= V: off), top-p (top_p >= 1: off), min-p (min_p <= 0: off), in Hugging Face's warper order (the definitions
   are sampling.probs_from_logits'), by inverse CDF with the uniform u in [0, 1): the first candidate whose running
   probability exceeds u. Candidates are ranked by value descending, equal values by id descending; with no
   truncation set the whole vocabulary is walked in order, without sorting. With top-k only the top k + slack values
   are ranked (every value tied with the k-th is taken); top-p and min-p without top-k take the top 64, 256, ...
   until their survivors are all inside (a prefix of the ranking), with the normalizer over the whole row.
   ids / probs (capacity cap, or NULL): the kept candidates and their probabilities, their number in *n_out (0 on
   the dense path). Returns the token; -1 when the row has no finite value (the caller's general path takes it);
   -2 when out of memory. */
long specdec_sample(const float *x, long V, int k, float t, double top_p, double min_p, double u, int64_t *ids,
                    double *probs, int cap, int *n_out) {
    if (n_out) *n_out = 0;
    float m = row_max(x, V);
    if (!(m > -__builtin_inff()) || !(t > 0.0f)) return -1;
    float inv_t = 1.0f / t;
    int topk = k > 0 && k < V, partial = !topk && (top_p < 1.0 || min_p > 0.0);
    if (!topk && !partial) return sample_dense(x, V, m, inv_t, u);
    double z_full = 0.0;
    if (partial && top_p < 1.0) { /* the whole row's weight: only top-p needs it (min-p compares values) */
        float e[16];
        for (long j = 0; j < V; j += 16) z_full += block_exp(x, j, j + 16 < V ? j + 16 : V, m, inv_t, e);
    }
    long n = topk ? (k + TIE_SLACK < V ? k + TIE_SLACK : V) : PARTIAL_START;
    float *cv = NULL, *hv = NULL;
    int64_t *ci = NULL;
    int32_t *hi = NULL;
    double *w = NULL;
    float *av = NULL; /* the whole row ranked (rank_all), once the candidate set grows to RANK_ALL_FROM */
    int64_t *ai = NULL;
    long an = 0, mass_n = 0; /* mass: the weight of the first mass_n candidates, summed in rank order: each pass's
                                candidates are the top values in descending order, a prefix of the next pass's, so
                                adding only the new terms gives the sum from scratch bitwise */
    double mass = 0.0;
    long result = -2, kept = 0;
    for (;;) {
        if (n > V) n = V;
        free(cv), free(hv), free(ci), free(hi), free(w);
        cv = malloc(sizeof(float) * n), hv = malloc(sizeof(float) * n), ci = malloc(sizeof(int64_t) * n);
        hi = malloc(sizeof(int32_t) * n), w = malloc(sizeof(double) * n);
        if (!cv || !hv || !ci || !hi || !w) goto done;
        long found;
        if (partial && n >= RANK_ALL_FROM) { /* a prefix of the ranked row: top_row's set, in rank_ties' order */
            if (!av) {
                av = malloc(sizeof(float) * V), ai = malloc(sizeof(int64_t) * V);
                if (!av || !ai || (an = rank_all(x, V, av, ai)) < 0) goto done;
            }
            found = n < an ? n : an;
            memcpy(cv, av, sizeof(float) * found), memcpy(ci, ai, sizeof(int64_t) * found);
        } else {
            found = top_row(x, V, (int)n, hv, hi, cv, ci);
        }
        float edge = cv[topk ? k - 1 : found - 1]; /* the k-th value / the last candidate */
        if (found == n && n < V && cv[n - 1] >= edge) { /* a run of ties crosses the selection's end: take it all */
            long all = count_at_least(x, V, edge);
            if (all > n) {
                n = all;
                continue;
            }
        }
        kept = 0;
        while (kept < found && (!topk || cv[kept] >= edge)) kept++;
        if (partial) { /* are all survivors inside the top n? */
            if (top_p < 1.0)
                for (long i = mass_n; i < kept; i++) mass += exp(((double)cv[i] - m) * inv_t);
            mass_n = kept;
            int enough = n == V || (top_p < 1.0 && mass / z_full >= top_p) ||
                         (min_p > 0.0 && ((double)cv[kept - 1] - cv[0]) * inv_t < log(min_p));
            if (!enough) {
                n *= 4;
                continue;
            }
        }
        break;
    }
    rank_ties(cv, ci, (int)kept);
    double z = 0.0;
    for (long i = 0; i < kept; i++) z += w[i] = exp(((double)cv[i] - cv[0]) * inv_t);
    if (top_p < 1.0) { /* drop the tail whose mass, summed from the bottom, is <= 1 - top_p; the top one stays */
        double scale = partial ? exp(((double)cv[0] - m) * inv_t) / z_full : 1.0 / z;
        double below = 0.0, cum = 0.0;
        if (partial) {
            for (long i = 0; i < kept; i++) below += w[i] * scale;
            below = below < 1.0 ? 1.0 - below : 0.0;
        }
        long last = 0;
        for (long i = kept - 1; i >= 0; i--) {
            cum += w[i] * scale;
            if (cum + below > 1.0 - top_p) {
                last = i;
                break;
            }
        }
        kept = last + 1;
    }
    if (min_p > 0.0) { /* drop tokens below min_p x the top probability (w[0] = 1 is the top) */
        long i = 1;
        while (i < kept && w[i] >= min_p * w[0]) i++;
        kept = i;
    }
    z = 0.0;
    for (long i = 0; i < kept; i++) z += w[i];
    double target = u * z, cum = 0.0;
    result = ci[kept - 1];
    for (long i = 0; i < kept; i++) {
        cum += w[i];
        if (cum > target) {
            result = ci[i];
            break;
        }
    }
    if (ids && kept <= cap) {
        for (long i = 0; i < kept; i++) ids[i] = ci[i], probs[i] = w[i] / z;
        if (n_out) *n_out = (int)kept;
    }
done:
    free(cv), free(hv), free(ci), free(hi), free(w), free(av), free(ai);
    return result;
}
