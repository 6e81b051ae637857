/* One fixed-order fp32 dot product, shared by gemv.c and attend.c: four 8-lane FMA accumulators
 * over the inputs (input i goes to accumulator (i / 8) % 4, lane i % 8), added as (a0 + a1) +
 * (a2 + a3), the 8 lanes then added in halves, and the inputs past the last multiple of 32 added
 * in order. */
#ifndef FEEDBACK_DOT_H
#define FEEDBACK_DOT_H
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

#endif
