/* The MLP half of a Llama decoder layer for a decode step's few rows, and the whole layer (with
 * attend.c's attention block) in one call: out = h + down(silu(gate(norm(h))) * up(norm(h))).
 *
 * Every step rounds where PyTorch's operations round in transformers' layer, so the result is its
 * bits: the norm is attend.c's, the products feedback_product's (the same kernels the layer's
 * op-by-op path takes: gemv's for fp32 weights, quant.c's for the quantised modes), the product of
 * the activation and `up` and the residual add are single roundings, and SiLU is computed as
 * PyTorch's CPU kernel computes it (below), which the caller checks against PyTorch itself on this
 * machine before using it (`lean._silu_block`).
 *
 * Built with -ffp-contract=off (like gemv.c, in the same library). */
#include <math.h>
#include <string.h>

#include "dot.h"
#include "kernels.h"

/* e^d, 8 lanes, as PyTorch's vectorised exp computes it (SLEEF's single-precision exp, 1-ulp
 * variant): d = q ln2 + s with q = round(d / ln2) and ln2 in two parts (each step one fused
 * multiply-add), e^s by a degree-7 polynomial in s evaluated by Horner's rule with fused
 * multiply-adds, then times 2^q as two exact powers of two (so a result below the normal range
 * rounds once, where PyTorch's does). Below -104 it is 0, above 100 infinity; NaN stays NaN. */
static inline __m256 exp_torch(__m256 d) {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137426645954f)));
    __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    __m256i half = _mm256_srai_epi32(q, 1), bias = _mm256_set1_epi32(0x7f);
    __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, half), bias), 23));
    u = _mm256_mul_ps(_mm256_mul_ps(u, lo), hi);
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
}

/* x[0..n) = silu(x) = x / (1 + e^-x) in place, as PyTorch's CPU kernel computes it over a
 * contiguous tensor of n values: the values up to the last multiple of `block` (two of its vectors:
 * 32 with AVX-512, 16 with AVX2) with the vectorised exp above, the rest with the C library's expf
 * (its scalar loop). Each value's result depends only on the value and which of the two it took. */
void feedback_silu(float *x, long n, long block) {
    long vectors = n - n % block, i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= vectors; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(x + i, _mm256_div_ps(v, _mm256_add_ps(one, exp_torch(_mm256_xor_ps(v, sign)))));
    }
    for (; i < vectors; i++) { /* block is a multiple of 8: not reached, kept for any block */
        float in[8] = {x[i]}, e[8];
        _mm256_storeu_ps(e, exp_torch(_mm256_xor_ps(_mm256_loadu_ps(in), sign)));
        x[i] = x[i] / (1.0f + e[0]);
    }
    for (; i < n; i++) x[i] = x[i] / (1.0f + expf(-x[i]));
}

/* The MLP half for rows of hidden [rows, width] (out may be hidden): the norm's weight and eps
 * (lanes: see attend.c's torch_row_sum); the fused gate/up projection [2 inter, width] (gate's rows
 * first) and the down projection [width, inter] (kernels.h); silu_block (see feedback_silu);
 * scratch of rows * (width + 3 inter) floats, then the products' (feedback_product_scratch for the
 * wider of width and inter). */
void feedback_mlp_block(const float *hidden, float *out, long rows, long width, const float *norm_w, float eps,
                        long lanes, const struct feedback_matrix *gate_up_m, const struct feedback_matrix *down_m,
                        long inter, long silu_block, float *scratch, int threads) {
    float *normed = scratch, *gate_up = normed + rows * width, *act = gate_up + rows * 2 * inter;
    float *down = normed, *products = act + rows * inter; /* the normed rows are read by the gate/up product only */
    feedback_rms_norm(hidden, norm_w, normed, rows, width, eps, lanes);
    feedback_product(gate_up_m, normed, gate_up, rows, width, 2 * inter, products, threads);
    /* the gate's rows side by side, as transformers' separate gate product lays them out: SiLU's
     * split between its vector and scalar loops counts positions in that tensor */
    for (long r = 0; r < rows; r++) memcpy(act + r * inter, gate_up + r * 2 * inter, inter * sizeof(float));
    feedback_silu(act, rows * inter, silu_block);
    for (long r = 0; r < rows; r++) {
        float *a = act + r * inter;
        const float *up = gate_up + r * 2 * inter + inter;
        for (long i = 0; i < inter; i++) a[i] = a[i] * up[i];
    }
    feedback_product(down_m, act, down, rows, inter, width, products, threads);
    for (long i = 0; i < rows * width; i++) out[i] = hidden[i] + down[i];
}

/* One decoder layer as the stack below reads it: its norms' weights and its products (kernels.h), its
 * cache's key and value buffers [rows, kv_heads, *, d] (strides kb, kh and vb, vh), the norms' eps
 * and the attention's scale. */
struct feedback_layer {
    const float *norm_w, *post_norm_w;
    struct feedback_matrix qkv, o, gate_up, down;
    float *k, *v;
    long kb, kh, vb, vh;
    float eps, post_eps, scale;
};

/* What every layer of one decode step shares: the rows and sizes, the norms' summing width (lanes:
 * see attend.c's torch_row_sum) and SiLU's block, the rotary cos and sin (row stride cs; 0: one
 * for every row), the position the new token takes in every layer's cache (attention then over
 * [0, at]), the mask keep [rows, at + 1] (row stride mb) or NULL, and the thread count. */
struct feedback_step {
    long rows, width, heads, kv_heads, d, inter, lanes, silu_block;
    const float *cos, *sin;
    long cs, at;
    const unsigned char *keep;
    long mb;
    int threads;
};

/* The floats of scratch feedback_decoder_stack needs. */
long feedback_stack_scratch(const struct feedback_step *s) {
    long widest = s->width > s->inter ? s->width : s->inter;
    widest = widest > s->heads * s->d ? widest : s->heads * s->d;
    long attention = s->rows * ((s->heads + 2 * s->kv_heads) * s->d + 2 * s->heads * s->d + s->width +
                                s->heads * (s->at + 1));
    long mlp = s->rows * (s->width + 3 * s->inter);
    return s->rows * s->width + (attention > mlp ? attention : mlp) + feedback_product_scratch(s->rows, widest);
}

/* `count` decoder layers' decode step, each the attention block then the MLP block above, from
 * hidden [rows, width] to out; then, where final_w is given, the model's final norm on out in
 * place. A layer without gate_up.w has its attention half only (its caller runs the MLP; it must
 * be the last). scratch: feedback_stack_scratch floats. */
void feedback_decoder_stack(const struct feedback_step *s, const struct feedback_layer *layers, long count,
                            const float *hidden, float *out, const float *final_w, float final_eps, float *scratch) {
    float *mid = scratch, *work = scratch + s->rows * s->width;
    const float *in = hidden;
    for (long i = 0; i < count; i++) {
        const struct feedback_layer *l = layers + i;
        feedback_attention_block(in, mid, s->rows, s->width, l->norm_w, l->eps, s->lanes, &l->qkv, s->cos, s->sin,
                                 s->cs, l->k, l->kb, l->kh, l->v, l->vb, l->vh, s->at, s->keep, s->mb, &l->o, s->heads,
                                 s->kv_heads, s->d, l->scale, work, s->threads);
        if (!l->gate_up.w) {
            memcpy(out, mid, s->rows * s->width * sizeof(float));
            return;
        }
        feedback_mlp_block(mid, out, s->rows, s->width, l->post_norm_w, l->post_eps, s->lanes, &l->gate_up, &l->down,
                           s->inter, s->silu_block, work, s->threads);
        in = out;
    }
    if (final_w) feedback_rms_norm(out, final_w, out, s->rows, s->width, final_eps, s->lanes);
}
