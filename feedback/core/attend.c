/* Attention of one query per row (a decode step) against a key/value cache with grouped heads.
 *
 * For each row and key/value head, the query heads of its group are scored against every attended
 * key (a dot product of head_dim values, summed as gemv.c sums them, times the scale), the scores
 * turned into weights by a softmax, and the values summed by weight. Keys the mask hides are
 * skipped: their weight is exactly 0, as PyTorch's softmax of a masked score is.
 *
 * Each row's result is bit-for-bit the same alone, in any batch, with any left padding in front of
 * it and at any thread count: sums over positions run one position at a time in order (never 8
 * positions to a vector, which would group them by where padding puts them), and threads split
 * rows and heads, never a sum.
 *
 * Built with -ffp-contract=off (gemv.c is compiled with it, in the same library). */
#include <math.h>

#include "dot.h"
#include "kernels.h"

/* e^x, 8 lanes, for x <= 0 (a score less the row's largest): x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by its Taylor series to r^7 (truncation < 6e-9 of it), then times 2^n. Below -87 it returns
 * e^-87 (~2e-38): against the largest score's weight of 1 that is 0 in any fp32 sum. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* ln 2 in two parts (Cody and Waite): n * hi is exact for |n| < 2^9 */
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f)));
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float exp1(float x) {
    float in[8] = {x}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

/* s[0..t) = softmax weights from scores (in place), positions with keep[t] == 0 given 0 */
static void softmax(float *s, const unsigned char *keep, long t) {
    float top = -INFINITY;
    for (long i = 0; i < t; i++)
        if ((!keep || keep[i]) && s[i] > top) top = s[i];
    long i = 0;
    __m256 m = _mm256_set1_ps(top);
    for (; i + 8 <= t; i += 8) _mm256_storeu_ps(s + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m)));
    for (; i < t; i++) s[i] = exp1(s[i] - top);
    float sum = 0.0f;
    for (i = 0; i < t; i++) {
        if (keep && !keep[i]) s[i] = 0.0f;
        sum += s[i];
    }
    float inv = 1.0f / sum;
    for (i = 0; i < t; i++) s[i] *= inv;
}

/* out[0..d) = sum over positions of w[i] * v[i * vs .. + d), one position at a time */
static void weighted(const float *w, const float *v, long vs, long t, long d, float *out) {
    long j = 0;
    for (; j + 32 <= d; j += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long i = 0; i < t; i++) {
            if (w[i] == 0.0f) continue; /* a hidden key: 0 * its value adds nothing */
            const float *vi = v + i * vs + j;
            __m256 wi = _mm256_set1_ps(w[i]);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(wi, _mm256_loadu_ps(vi)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(wi, _mm256_loadu_ps(vi + 8)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(wi, _mm256_loadu_ps(vi + 16)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(wi, _mm256_loadu_ps(vi + 24)));
        }
        _mm256_storeu_ps(out + j, a0);
        _mm256_storeu_ps(out + j + 8, a1);
        _mm256_storeu_ps(out + j + 16, a2);
        _mm256_storeu_ps(out + j + 24, a3);
    }
    for (; j < d; j++) {
        float a = 0.0f;
        for (long i = 0; i < t; i++)
            if (w[i] != 0.0f) a += w[i] * v[i * vs + j];
        out[j] = a;
    }
}

/* the query heads of one row's key/value head (job = row * kv_heads + kv head) */
static inline void attend_group(const float *q, long qb, long qh, const float *k, long kb, long kh, long kt,
                                const float *v, long vb, long vh, long vt, const unsigned char *keep, long mb,
                                float *scratch, float *out, long heads, long kv_heads, long group, long t, long d,
                                float scale, long job) {
    long r = job / kv_heads, g = job % kv_heads;
    const float *kg = k + r * kb + g * kh, *vg = v + r * vb + g * vh;
    const unsigned char *mask = keep ? keep + r * mb : 0;
    for (long h = g * group; h < (g + 1) * group; h++) {
        const float *qr = q + r * qb + h * qh;
        float *s = scratch + (r * heads + h) * t;
        for (long i = 0; i < t; i++) s[i] = (!mask || mask[i]) ? dot1(kg + i * kt, qr, d) * scale : 0.0f;
        softmax(s, mask, t);
        weighted(s, vg, vt, t, d, out + (r * heads + h) * d);
    }
}

/* One query per row: q [rows, heads, d] (strides qb, qh), k and v [rows, kv_heads, t, d] (strides
 * kb, kh, kt and vb, vh, vt), keep [rows, t] (stride mb; NULL: every key), scratch [rows * heads * t];
 * out [rows, heads, d] contiguous. Query head h reads key/value head h / (heads / kv_heads). */
void feedback_attend(const float *q, long qb, long qh, const float *k, long kb, long kh, long kt,
                     const float *v, long vb, long vh, long vt, const unsigned char *keep, long mb,
                     float *scratch, float *out, long rows, long heads, long kv_heads, long t, long d,
                     float scale, int threads) {
    long group = heads / kv_heads, jobs = rows * kv_heads;
    /* one thread, or too little work to wake the others: no parallel region */
    if (threads <= 1 || rows * heads * t * d < 65536) {
        for (long job = 0; job < jobs; job++)
            attend_group(q, qb, qh, k, kb, kh, kt, v, vb, vh, vt, keep, mb, scratch, out, heads, kv_heads, group,
                         t, d, scale, job);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long job = 0; job < jobs; job++)
        attend_group(q, qb, qh, k, kb, kh, kt, v, vb, vh, vt, keep, mb, scratch, out, heads, kv_heads, group, t,
                     d, scale, job);
}

/* x rotated as transformers' rotary embedding rotates it, (x * cos) + (rotate_half(x) * sin) with
 * rotate_half(x) = (-x[half:], x[:half]): each product rounded, then the sum, as PyTorch's three
 * elementwise ops round them, so the result is theirs bit for bit */
static inline void rotate(const float *x, const float *c, const float *s, float *out, long d) {
    long half = d / 2;
    for (long i = 0; i < half; i++) {
        float a = x[i] * c[i], b = -x[i + half] * s[i];
        out[i] = a + b;
    }
    for (long i = half; i < d; i++) {
        float a = x[i] * c[i], b = x[i - half] * s[i];
        out[i] = a + b;
    }
}

/* A decode step's one new token a row, from the fused q/k/v projection's output qkv [rows, (heads +
 * 2 kv_heads) d]: the queries rotated into q [rows, heads, d], the keys rotated and the values
 * copied into the cache at k and v (the token's slot of each row's first key/value head; strides
 * kb, kh and vb, vh). cos and sin [rows, d] (row stride cs; 0: one for every row). */
void feedback_rope_append(const float *qkv, const float *cos, const float *sin, long cs, float *q, float *k, long kb,
                          long kh, float *v, long vb, long vh, long rows, long heads, long kv_heads, long d) {
    long width = (heads + 2 * kv_heads) * d;
    for (long r = 0; r < rows; r++) {
        const float *x = qkv + r * width, *c = cos + r * cs, *s = sin + r * cs;
        for (long h = 0; h < heads; h++) rotate(x + h * d, c, s, q + (r * heads + h) * d, d);
        for (long g = 0; g < kv_heads; g++) {
            rotate(x + (heads + g) * d, c, s, k + r * kb + g * kh, d);
            const float *xv = x + (heads + kv_heads + g) * d;
            float *to = v + r * vb + g * vh;
            for (long i = 0; i < d; i++) to[i] = xv[i];
        }
    }
}

/* ceil(log2(x)), 1 for x <= 2 */
static inline long ceil_log2(long x) {
    if (x <= 2) return 1;
    long bits = 0;
    for (unsigned long v = (unsigned long)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* x[i] squared, rounded as PyTorch's pow(2) rounds it (one product) */
static inline float sq(const float *x, long i) { return x[i] * x[i]; }

/* The sum of the squares of x[0..n) in the order of PyTorch's CPU sum over a contiguous row with
 * `lanes`-wide vectors (8 with AVX2, 16 with AVX-512; at most 16): the vectors taken four at a time into four
 * accumulators, which a four-level cascade empties upward every 16 steps (a level every 2^4 of the
 * one below); the vectors past the last four into the first accumulator; the four added in order;
 * then, from 0, the values past the last vector and the lanes in order. Each lane's additions
 * are the vector code's, so the total is the same bits. The caller checks that on this machine
 * against PyTorch itself before using it (`lean._norm_lanes`). */
static float torch_row_sum(const float *x, long n, long lanes) {
    enum { LEVELS = 4, ILP = 4, MAX_LANES = 16 };
    float acc[LEVELS][ILP][MAX_LANES] = {{{0}}};
    long vectors = n / lanes, blocks = vectors / ILP;
    long power = ceil_log2(blocks) / LEVELS;
    if (power < 4) power = 4;
    long step = 1L << power, mask = step - 1, i = 0;
    while (i + step <= blocks) {
        for (long j = 0; j < step; j++, i++)
            for (long k = 0; k < ILP; k++)
                for (long l = 0; l < lanes; l++) acc[0][k][l] += sq(x, (i * ILP + k) * lanes + l);
        for (long j = 1; j < LEVELS; j++) {
            for (long k = 0; k < ILP; k++)
                for (long l = 0; l < lanes; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < blocks; i++)
        for (long k = 0; k < ILP; k++)
            for (long l = 0; l < lanes; l++) acc[0][k][l] += sq(x, (i * ILP + k) * lanes + l);
    for (long j = 1; j < LEVELS; j++)
        for (long k = 0; k < ILP; k++)
            for (long l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
    for (long iv = blocks * ILP; iv < vectors; iv++)
        for (long l = 0; l < lanes; l++) acc[0][0][l] += sq(x, iv * lanes + l);
    for (long k = 1; k < ILP; k++)
        for (long l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (long t = vectors * lanes; t < n; t++) total += sq(x, t);
    for (long l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)) for rows r of n values, each step rounded where
 * transformers' RMS norm (PyTorch's ops) rounds it: the squares, their sum (above), the mean (a
 * division by n), + eps, 1 / sqrt, x times that, times w. */
void feedback_rms_norm(const float *x, const float *w, float *y, long rows, long n, float eps, long lanes) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float mean = torch_row_sum(xr, n, lanes) / (float)n;
        float scale = 1.0f / sqrtf(mean + eps);
        for (long i = 0; i < n; i++) {
            float h = xr[i] * scale;
            y[r * n + i] = h * w[i];
        }
    }
}

/* The attention half of a lean Llama layer for a decode step's few rows, in one call: out = hidden
 * + o(attention(rope(qkv(norm(hidden))))), every step the kernel above (or gemv's) that the layer's
 * op-by-op path takes, so the result is its bits. hidden, out [rows, width]; the norm's weight and
 * eps (lanes: see torch_row_sum); the fused q/k/v projection [(heads + 2 kv_heads) d, width]
 * (kernels.h); cos, sin (row stride cs); the cache's key and value buffers [rows, kv_heads, *, d]
 * (strides kb, kh, d) whose position `at` the new token takes, attention then over positions
 * [0, at]; keep [rows, at + 1] (stride mb) or NULL; the output projection [width, heads d]; scratch
 * of rows * ((heads + 2 kv_heads) d + 2 heads d + width + heads (at + 1)) floats, then the
 * products' (feedback_product_scratch for the wider of width and heads d). */
void feedback_attention_block(const float *hidden, float *out, long rows, long width, const float *norm_w, float eps,
                              long lanes, const struct feedback_matrix *qkv_m, const float *cos, const float *sin,
                              long cs, float *k, long kb, long kh, float *v, long vb, long vh, long at,
                              const unsigned char *keep, long mb, const struct feedback_matrix *o, long heads,
                              long kv_heads, long d, float scale, float *scratch, int threads) {
    long fused = (heads + 2 * kv_heads) * d, t = at + 1;
    float *normed = scratch, *qkv = normed + rows * width, *q = qkv + rows * fused, *attn = q + rows * heads * d;
    float *scores = attn + rows * heads * d, *products = scores + rows * heads * t;
    feedback_rms_norm(hidden, norm_w, normed, rows, width, eps, lanes);
    feedback_product(qkv_m, normed, qkv, rows, width, fused, products, threads);
    feedback_rope_append(qkv, cos, sin, cs, q, k + at * d, kb, kh, v + at * d, vb, vh, rows, heads, kv_heads, d);
    feedback_attend(q, heads * d, d, k, kb, kh, d, v, vb, vh, d, keep, mb, scores, attn, rows, heads, kv_heads, t, d,
                    scale, threads);
    feedback_product(o, attn, out, rows, heads * d, width, products, threads);
    for (long i = 0; i < rows * width; i++) out[i] = hidden[i] + out[i];
}
