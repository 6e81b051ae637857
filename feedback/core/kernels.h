/* What the decode kernels' files call in one another (gemv.c, attend.c, layer.c, quant.c). */
#ifndef FEEDBACK_KERNELS_H
#define FEEDBACK_KERNELS_H

/* A linear layer's weights as a decode step reads them: kind 0 fp32 (w [out, in], gemv.c), 4 int4
 * (w the codes, s the scales, z the offsets) or 8 int8 (w the codes, s the scales; quant.c); b the
 * fp32 bias or NULL. */
struct feedback_matrix {
    const void *w, *s, *z;
    const float *b;
    long kind;
};

void feedback_gemv(const float *x, const float *w, const float *b, float *y, long rows, long in, long out,
                   int threads);
/* y[rows, out] = x[rows, in] W^T (+ b) by m's kernel; scratch: feedback_product_scratch floats */
void feedback_product(const struct feedback_matrix *m, const float *x, float *y, long rows, long in, long out,
                      float *scratch, int threads);
long feedback_product_scratch(long rows, long in);
void feedback_rms_norm(const float *x, const float *w, float *y, long rows, long n, float eps, long lanes);
void feedback_attention_block(const float *hidden, float *out, long rows, long width, const float *norm_w, float eps,
                              long lanes, const struct feedback_matrix *qkv, const float *cos, const float *sin,
                              long cs, float *k, long kb, long kh, float *v, long vb, long vh, long at,
                              const unsigned char *keep, long mb, const struct feedback_matrix *o, long heads,
                              long kv_heads, long d, float scale, float *scratch, int threads);

#endif
