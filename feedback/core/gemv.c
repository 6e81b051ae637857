/* fp32 products for a few rows (decode steps), y = x W^T + b with W stored [out, in] as nn.Linear
 * keeps it. Each output is one dot product of a weight row with an input row, streamed once from
 * memory for every row of the batch: the bound at 1 to 4 rows is memory, not arithmetic.
 *
 * A row's sums have one fixed order whatever the batch: four 8-lane accumulators over the inputs
 * (input i goes to accumulator (i / 8) % 4, lane i % 8), added as (a0 + a1) + (a2 + a3), the 8
 * lanes then added in halves, and the inputs past the last multiple of 32 added in order. Rows are
 * taken in pairs only to read each weight vector once for both; each row's operations are the same
 * as alone. So a row's result is bit-for-bit the same alone, in any batch, and at any thread count
 * (threads split the outputs, never a sum).
 *
 * Built with -ffp-contract=off so the compiler fuses no multiply-add the code does not spell out. */
#include <immintrin.h>

static inline float lanes(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline float rest(float t, const float *w, const float *x, long i, long n) {
    for (; i < n; i++) t += w[i] * x[i];
    return t;
}

#define LOAD4(w, p, i)                          \
    __m256 w##0 = _mm256_loadu_ps(p + i);       \
    __m256 w##1 = _mm256_loadu_ps(p + i + 8);   \
    __m256 w##2 = _mm256_loadu_ps(p + i + 16);  \
    __m256 w##3 = _mm256_loadu_ps(p + i + 24);

#define FMA4(a, w, x, i)                                               \
    a##0 = _mm256_fmadd_ps(w##0, _mm256_loadu_ps(x + i), a##0);        \
    a##1 = _mm256_fmadd_ps(w##1, _mm256_loadu_ps(x + i + 8), a##1);    \
    a##2 = _mm256_fmadd_ps(w##2, _mm256_loadu_ps(x + i + 16), a##2);   \
    a##3 = _mm256_fmadd_ps(w##3, _mm256_loadu_ps(x + i + 24), a##3);

/* one weight row with one input row */
static inline float dot1(const float *w, const float *x, long n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long i = 0;
    for (; i + 32 <= n; i += 32) {
        LOAD4(v, w, i)
        FMA4(a, v, x, i)
    }
    return rest(lanes(a0, a1, a2, a3), w, x, i, n);
}

/* one weight row with two input rows, each summed exactly as dot1 sums it */
static inline void dot2(const float *w, const float *x, const float *z, long n, float *rx, float *rz) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    long i = 0;
    for (; i + 32 <= n; i += 32) {
        LOAD4(v, w, i)
        FMA4(a, v, x, i)
        FMA4(b, v, z, i)
    }
    *rx = rest(lanes(a0, a1, a2, a3), w, x, i, n);
    *rz = rest(lanes(b0, b1, b2, b3), w, z, i, n);
}

/* y[rows, out] = x[rows, in] w[out, in]^T (+ b[out]); every array contiguous. */
void feedback_gemv(const float *x, const float *w, const float *b, float *y, long rows, long in, long out,
                   int threads) {
    /* a product this small costs less than waking the other threads */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && out * in >= 65536)
    for (long o = 0; o < out; o++) {
        const float *wo = w + o * in;
        float bo = b ? b[o] : 0.0f;
        long r = 0;
        for (; r + 2 <= rows; r += 2) {
            float p, q;
            dot2(wo, x + r * in, x + (r + 1) * in, in, &p, &q);
            y[r * out + o] = p + bo;
            y[(r + 1) * out + o] = q + bo;
        }
        if (r < rows) y[r * out + o] = dot1(wo, x + r * in, in) + bo;
    }
}
