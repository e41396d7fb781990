/* The decoder layers of a forward in one call: for Llama-family, Qwen3 and Gemma 3 dense layers on the "kernel"
   attention plan, the six kernel calls of a layer (fused RMSNorm + QKV projection, RoPE and cache writes, attention,
   output projection + residual, fused RMSNorm + gate/up + SwiGLU, down projection + residual) issued from C for
   layers [i0, i1), instead of from Python, where each call cost ~5-7 us of wrapper code (tensor allocation, checks,
   ctypes) on top of its kernel: ~1 ms of a 3.9 ms SmolLM2 decode step (docs/results/forward-fast.txt). The q / k
   head norms (Qwen3, Gemma 3) and Gemma's norms after attention and FFN run here in plain C, each row alone (so
   batch-invariant), and Gemma's GELU in the gate/up matmul as SwiGLU's SiLU is (matmul.c's swiglu = 2, on the f32
   sums, with the exp of its SiLU: no libm tanhf, no pass of its own; docs/results/forward-par-1207g.txt), instead
   of ~25 small PyTorch ops a Gemma layer (docs/results/forward-gemma.txt); their roundings are not those of the
   PyTorch ops, so for those layers the two paths agree closely, not bitwise (tested).

   The kernels are the very functions the Python path calls (their addresses in the loaded matmul and attention
   libraries), with the same arguments, so every Llama-family output is bitwise the Python path's (tested). The
   residual stream x is updated in place (the matmul kernel reads each residual element before writing the same
   element).

   EAGLE-3's features (the inputs of its aux layers) are copied out as the loop passes them, into columns of the
   caller's hidden-output rows, instead of splitting the loop at each aux layer and copying in Python: that cost
   ~0.2 ms of a 3.1 ms SmolLM2 step (docs/results/eagle3-step.txt). */

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int (*matmul_fn)(const void *x, int T, int K, int N, int bits, const uint8_t *w, const uint16_t *s,
                         const uint16_t *z, void *y, int bf16, const float *norm, float eps, int swiglu,
                         const void *residual);
typedef void (*rope_fn)(void *qkv, int T, int H, int Hkv, int D, const float *cos, const float *sin, void *kv,
                        void *kt, long tiles, const int64_t *slots, int esize);
typedef int (*attend_fn)(const void *q, long q_stride, const void *kv, const void *kt, long tiles, int H, int Hkv,
                         int D, int T, const int64_t *lo, const int64_t *hi, const int64_t *tails,
                         const int64_t *toff, float scale, void *out, int bf16);

/* One layer's record, int64 fields: for each of the four linear layers (qkv, o, gate/up, down) its codes, scales,
   zeros (0: none), bits and output rows; then the two norms' f32 weights and whether the layer is sliding; then
   Gemma 3's parts (0 where a layer has none): the q / k heads' RMSNorm weights (f32 [H + Hkv, D]), the norms after
   the attention and after the FFN ("sandwich", f32 [dim]), and whether the FFN's gate is GELU (tanh) instead of
   SiLU. */
enum {
    LIN = 5, QKV = 0, O = LIN, W13 = 2 * LIN, W2 = 3 * LIN, ATTN_NORM = 4 * LIN, FFN_NORM, SLIDING, QK_NORM,
    POST_ATTN_NORM, POST_FFW_NORM, GELU, FIELDS
};

#define P(v) ((void *)(intptr_t)(v))
#ifndef PAR_MIN
#define PAR_MIN 1024 /* elements of an elementwise step below which it runs on the calling thread alone */
#endif

static inline float get(const void *x, int bf16, long i) {
    if (!bf16) return ((const float *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void put(void *x, int bf16, long i, float f) {
    if (!bf16) {
        ((float *)x)[i] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    ((uint16_t *)x)[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); /* round to nearest even, as torch */
}

/* 1 / sqrt(mean(x^2) + eps) of row x[0..n), the sum in f32 in element order */
static inline float inv_rms(const void *x, int bf16, long at, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) {
        float v = get(x, bf16, at + i);
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)n + eps);
}

/* RMSNorm (Zhang & Sennrich 2019) of T rows x [T, dim] into out, times w [dim] (f32), each row alone: the final norm
   of a forward, here or (models/transformer.py, layer by layer) through kernels.rms_norm, so both paths agree */
void specdec_rms_norm(const void *x, int T, int dim, const float *w, float eps, void *out, int bf16) {
    for (int t = 0; t < T; t++) {
        long at = (long)t * dim;
        float r = inv_rms(x, bf16, at, dim, eps);
        for (int i = 0; i < dim; i++) put(out, bf16, at + i, get(x, bf16, at + i) * r * w[i]);
    }
}

/* RMSNorm (Zhang & Sennrich 2019) of each of the n_heads heads (D wide) of each of T rows of width row, in place,
   times w [n_heads, D] (Gemma 3's q / k norms: each row computed alone, so batch-invariant). The (row, head) pairs
   are shared among the threads, each pair computed whole by one of them as before, so the results are the same
   bitwise whatever the thread count. */
static void head_norms(void *x, int bf16, int T, long row, int n_heads, int D, const float *w, float eps) {
#pragma omp parallel for schedule(static) if ((long)T * n_heads * D >= PAR_MIN)
    for (long th = 0; th < (long)T * n_heads; th++) {
        long t = th / n_heads, h = th % n_heads, at = t * row + h * D;
        float r = inv_rms(x, bf16, at, D, eps);
        for (int d = 0; d < D; d++) put(x, bf16, at + d, get(x, bf16, at + d) * r * w[h * D + d]);
    }
}

/* x += RMSNorm(y) w, row by row (the sandwich norm before a residual add, Gemma 2 / 3) */
static void norm_add(void *x, const void *y, int bf16, int T, int dim, const float *w, float eps) {
#pragma omp parallel for schedule(static) if (T > 1 && (long)T * dim >= PAR_MIN) /* rows whole, as head_norms */
    for (int t = 0; t < T; t++) {
        long at = (long)t * dim;
        float r = inv_rms(y, bf16, at, dim, eps);
        for (int i = 0; i < dim; i++)
            put(x, bf16, at + i, get(x, bf16, at + i) + get(y, bf16, at + i) * r * w[i]);
    }
}

static int linear(matmul_fn mm, const int64_t *l, const void *x, int T, int K, void *y, int bf16,
                  const float *norm, float eps, int swiglu, const void *residual) {
    return mm(x, T, K, (int)l[4], (int)l[3], P(l[0]), P(l[1]), P(l[2]), y, bf16, norm, eps, swiglu, residual);
}

/* layers [i0, i1) of records L over T rows: x [T, dim] (in place), scratch qkv [T, (H + 2 Hkv) D], o [T, H D],
   h [T, ffn] (act(gate) * up), y [T, dim]; kv / kt: each layer's values [Hkv, S, D] and key tiles; cos / sin (and
   the local tables of sliding layers) f32 [T, D]; slots [T]; spans / tails of the full and the sliding plan
   (kernels.row_spans); n_feat features: layer feat_layer[j]'s input rows copied to feats [T, feat_row] at column
   feat_col[j]; out_norm (f32 [dim], or NULL): the final RMSNorm of x's rows into out [T, dim], with out_eps (in
   PyTorch its 4 small ops cost a SmolLM2 decode step 0.15 ms, their code cold after the layers streamed the weights:
   docs/results/step-glue-1206.txt).
   Returns 0, or the first failing kernel's code (-1: out of memory, -2: shapes). */
int specdec_layers(const int64_t *L, int i0, int i1, const int64_t *kv, const int64_t *kt, long tiles, int T,
                   int dim, int H, int Hkv, int D, int ffn, float eps, float scale, int bf16, void *x, void *qkv,
                   void *o, void *h, void *y, const float *cos, const float *sin, const float *cos_l,
                   const float *sin_l, const int64_t *slots, const int64_t *spans_f, const int64_t *tails_f,
                   const int64_t *spans_s, const int64_t *tails_s, const void *mm_p, const void *rope_p,
                   const void *att_p, int n_feat, const int64_t *feat_layer, const int64_t *feat_col, void *feats,
                   long feat_row, const float *out_norm, float out_eps, void *out) {
    matmul_fn mm = (matmul_fn)mm_p;
    rope_fn rope = (rope_fn)rope_p;
    attend_fn att = (attend_fn)att_p;
    int esize = bf16 ? 2 : 4, rc;
    for (int i = i0; i < i1; i++) {
        const int64_t *l = L + (long)i * FIELDS;
        int sl = (int)l[SLIDING];
        const int64_t *spans = sl ? spans_s : spans_f, *tails = sl ? tails_s : tails_f;
        for (int j = 0; j < n_feat; j++)
            if (feat_layer[j] == i)
                for (int t = 0; t < T; t++)
                    memcpy((char *)feats + ((long)t * feat_row + feat_col[j]) * esize, (char *)x + (long)t * dim * esize,
                           (size_t)dim * esize);
        if ((rc = linear(mm, l + QKV, x, T, dim, qkv, bf16, P(l[ATTN_NORM]), eps, 0, 0))) return rc;
        if (l[QK_NORM]) head_norms(qkv, bf16, T, (long)(H + 2 * Hkv) * D, H + Hkv, D, P(l[QK_NORM]), eps);
        rope(qkv, T, H, Hkv, D, sl ? cos_l : cos, sl ? sin_l : sin, P(kv[i]), P(kt[i]), tiles, slots, esize);
        rc = att(qkv, (long)(H + 2 * Hkv) * D, P(kv[i]), P(kt[i]), tiles, H, Hkv, D, T, spans, spans + T, tails,
                 spans + 2 * T, scale, o, bf16);
        if (rc) return rc;
        if (l[POST_ATTN_NORM]) {
            if ((rc = linear(mm, l + O, o, T, H * D, y, bf16, 0, 0.0f, 0, 0))) return rc;
            norm_add(x, y, bf16, T, dim, P(l[POST_ATTN_NORM]), eps);
        } else if ((rc = linear(mm, l + O, o, T, H * D, x, bf16, 0, 0.0f, 0, x))) {
            return rc;
        }
        if ((rc = linear(mm, l + W13, x, T, dim, h, bf16, P(l[FFN_NORM]), eps, l[GELU] ? 2 : 1, 0))) return rc;
        if (l[POST_FFW_NORM]) {
            if ((rc = linear(mm, l + W2, h, T, ffn, y, bf16, 0, 0.0f, 0, 0))) return rc;
            norm_add(x, y, bf16, T, dim, P(l[POST_FFW_NORM]), eps);
        } else if ((rc = linear(mm, l + W2, h, T, ffn, x, bf16, 0, 0.0f, 0, x))) {
            return rc;
        }
    }
    if (out_norm)
        specdec_rms_norm(x, T, dim, out_norm, out_eps, out, bf16);
    return 0;
}
