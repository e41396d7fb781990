/* The n largest values of each row of a float32 matrix, with their indices: the first step of sampling with top-k
   (sampling.py), where torch.topk over a 49152-token vocabulary costs 70-170 us per row on this CPU.

   One pass per row: a min-heap of the n best so far; 16 values at a time are compared with the heap's minimum
   (AVX-512 where the compiler targets it, else plain loops vectorized by the compiler) and only those above it are
   inserted, which after the first few thousand values is rare. Output sorted by value, descending; equal values in
   no particular order (callers rank ties themselves). NaN compares false everywhere and is never selected. */

#include <stdint.h>
#include <stdlib.h>

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
        const float *row = x + r * stride;
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
            for (long t = j; t < end; t++) any |= row[t] > lo;
            if (!any) continue;
            for (long t = j; t < end; t++)
                if (row[t] > hv[0]) {
                    hv[0] = row[t], hi[0] = (int32_t)t;
                    sift_down(hv, hi, size, 0);
                }
        }
        /* heap -> descending order: pop the minimum into the last free slot */
        float *ov = out_v + r * n;
        int64_t *oi = out_i + r * n;
        for (int k = size - 1; k >= 0; k--) {
            ov[k] = hv[0], oi[k] = hi[0];
            hv[0] = hv[k], hi[0] = hi[k];
            sift_down(hv, hi, k, 0);
        }
        for (int k = size; k < n; k++) ov[k] = -__builtin_inff(), oi[k] = 0; /* rows of NaN only */
    }
    free(hv), free(hi);
    return 0;
}
