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
 * The loops can ask for the weights ahead of where they read (feedback_gemv_ahead): it changes what
 * is in the cache, never an operation, so the results are the same bits. Whether it pays is the
 * CPU's: on an Intel Xeon (1 thread, the embedded model's decoder products in turn) asking 2 KB
 * ahead took one row from 43.0 to 40.4 ms and two from 53.1 to 44.1
 * (docs/results/compiled_choices.txt); on an AMD EPYC the same for one row took more CPU time. So
 * the loader times it (`linear.choose_ahead`).
 *
 * Built with -ffp-contract=off so the compiler fuses no multiply-add the code does not spell out. */
#include "dot.h"

/* bytes ahead of a weight row's reads that the one-row and the two-row loops ask for (0: none) */
static long ahead_one, ahead_two;

/* sets them (a negative one is left as it is) */
void feedback_gemv_ahead(long one, long two) {
    if (one >= 0) ahead_one = one;
    if (two >= 0) ahead_two = two;
}

/* dot1 (dot.h), the weights asked for `ahead` bytes on where not 0: the same operations in the
 * same order */
static inline float dot1_ahead(const float *w, const float *x, long n, long ahead) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long i = 0;
    for (; i + 32 <= n; i += 32) {
        if (ahead) {
            _mm_prefetch((const char *)(w + i) + ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + i) + ahead + 64, _MM_HINT_T0);
        }
        LOAD4(v, w, i)
        FMA4(a, v, x, i)
    }
    return rest(lanes(a0, a1, a2, a3), w, x, i, n);
}

/* one weight row with two input rows, each summed exactly as dot1 sums it (the weights asked for
 * `ahead` bytes on, where not 0, written out as in dot1_ahead: the two prefetches in one shared
 * inline function measured these loops 10-20 % slower at 1 thread, the same instructions laid out
 * otherwise) */
static inline void dot2(const float *w, const float *x, const float *z, long n, float *rx, float *rz, long ahead) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    long i = 0;
    for (; i + 32 <= n; i += 32) {
        if (ahead) {
            _mm_prefetch((const char *)(w + i) + ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + i) + ahead + 64, _MM_HINT_T0);
        }
        LOAD4(v, w, i)
        FMA4(a, v, x, i)
        FMA4(b, v, z, i)
    }
    *rx = rest(lanes(a0, a1, a2, a3), w, x, i, n);
    *rz = rest(lanes(b0, b1, b2, b3), w, z, i, n);
}

/* output o of every row */
static inline void output(const float *x, const float *w, const float *b, float *y, long rows, long in, long out,
                          long o) {
    const float *wo = w + o * in;
    float bo = b ? b[o] : 0.0f;
    long r = 0;
    for (; r + 2 <= rows; r += 2) {
        float p, q;
        dot2(wo, x + r * in, x + (r + 1) * in, in, &p, &q, ahead_two);
        y[r * out + o] = p + bo;
        y[(r + 1) * out + o] = q + bo;
    }
    if (r < rows) y[r * out + o] = dot1_ahead(wo, x + r * in, in, ahead_one) + bo;
}

/* y[rows, out] = x[rows, in] w[out, in]^T (+ b[out]); every array contiguous. */
void feedback_gemv(const float *x, const float *w, const float *b, float *y, long rows, long in, long out,
                   int threads) {
    /* one thread, or a product this small (it costs less than waking the other threads): no
     * parallel region at all, whose entry and exit cost something even for a team of one */
    if (threads <= 1 || out * in < 65536) {
        for (long o = 0; o < out; o++) output(x, w, b, y, rows, in, out, o);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < out; o++) output(x, w, b, y, rows, in, out, o);
}
