/* Weight-only quantised products for a decode step's few rows, in the numerics of the engine's
 * quantised modes (`feedback.core.linear`): the input rounded to bf16, the weights' integer codes
 * times their bf16 scales (plus a bf16 offset for int4), the result rounded to bf16 and then the
 * fp32 bias added, as PyTorch's packed kernels compute a bf16 product that the layer then adds its
 * bias to.
 *
 * The products are taken in integers: each group of 32 inputs of a row is written as 16-bit
 * integers q on a power of two r chosen from the group's largest magnitude (x = q r, |q| < 2^15),
 * and a group's sum of code times q is exact in 32-bit integers (pmaddwd), then turned to float and
 * scaled once. A bf16 value within 2^7 of its group's largest is represented exactly (it has 8
 * significant bits); a smaller one is rounded at 2^-15 of the largest's scale, under a hundredth of
 * the largest value's own bf16 rounding. So the result differs from PyTorch's kernels only in the
 * order of the sums, while each code costs a few integer operations instead of a conversion to float
 * and a multiply-add: fed floats, one row is bound by arithmetic rather than by reading the codes.
 *
 * int4: each output's inputs in groups of 32, a group's 16 bytes holding input j's code (0..15) in
 * byte j's low half and input j + 16's in its high half; per group a scale s and an offset z (the
 * value of code 8), so a weight is (code - 8) s + z, and a group's part of the dot product is
 * s r sum(code q) + (z - 8 s) sum(x). int8: codes -128..127 stored [out, in] as they are, one scale
 * per output.
 *
 * Two widths: 256-bit loops (AVX2) take a group an instruction; 512-bit ones (AVX-512 BW and VNNI,
 * where the CPU has them) take two, the prepared rows laid out so one register lines up with two
 * groups' codes. Their integer sums are the same and every float operation is the same lane by lane,
 * so the two give the same bits (tested), and the loader keeps the faster (`linear.choose_ahead`).
 *
 * A row's operations are the same whatever the other rows, so its result is bit-for-bit the same
 * alone or in a batch, and at any thread count (threads split the outputs). Built with
 * -ffp-contract=off like gemv.c, in the same library. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* How far ahead (bytes of int4 codes; 0: not at all) the kernels ask for the weights they will
 * read: the scales and offsets a quarter as far, int8 codes half as far. It changes no result.
 * These kernels spend few cycles a byte and can stall on memory: on an Intel Xeon (1 thread, the
 * embedded model's layers in turn) the int4 products took 7.8 ms a step 4 KB ahead and 12.1
 * without (docs/results/compiled_choices.txt). Whether it pays is the CPU's, so the loader times it
 * (`linear.choose_ahead`). */
static long ahead;

void feedback_quant_ahead(long bytes) {
    if (bytes >= 0) ahead = bytes; /* negative: left as it is */
}

#define GROUP 32 /* inputs per group: int4's scale and offset, and a row's 16-bit scale */

/* 8 bf16 values (raw 16-bit patterns) as floats */
static inline __m256 bf16x8(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* 8 floats rounded to the nearest bf16 (ties to even), as PyTorch's float -> bfloat16 conversion
 * rounds them (a NaN stays a NaN: its group is NaN below) */
static inline __m256 bf16_round8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline float bf16_round(float f) {
    float in[8] = {f}, out[8];
    _mm256_storeu_ps(out, bf16_round8(_mm256_loadu_ps(in)));
    return isnan(f) ? f : out[0];
}

static inline float hsum(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline float hmax(__m256 a) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline long groups_of(long in) { return (in + GROUP - 1) / GROUP; }
/* groups padded to whole blocks of 8, the block the int4 kernel reads scales in */
static inline long padded_groups(long in) { return (groups_of(in) + 7) / 8 * 8; }
/* 16-bit values of a prepared row: whole pairs of groups */
static inline long row_values(long in) { return (groups_of(in) + 1) / 2 * 2 * GROUP; }

/* The floats of scratch feedback_product needs for `rows` rows of `in` inputs (whatever m's kind):
 * the quantised kernels' rows as 16-bit integers (a whole number of pairs of groups), and each
 * group's power of two and sum. */
long feedback_product_scratch(long rows, long in) { return rows * (row_values(in) / 2 + 2 * padded_groups(in)); }

/* A prepared row's group g: its inputs 0..15 (second 0) or 16..31 (second 1), 16 values. Groups
 * come in pairs (g even, g + 1): g's first half, g + 1's first half, g's second half, g + 1's second
 * half, so one 512-bit register holds the same half of two groups, lined up with two groups' int4
 * codes. */
static inline const int16_t *half(const int16_t *q, long g, int second) {
    return q + (g & ~1L) * GROUP + second * 32 + (g & 1) * 16;
}

/* Row group x[0..n) (n <= 32) rounded to bf16, as q (0 past n; inputs 0..15 in lo, 16..31 in hi)
 * on the power of two *r, and its sum *sum. A group with a NaN or infinity gets r and sum NaN (its
 * outputs are NaN); one whose largest magnitude is below 2^-113 is all 0. */
static inline void prepare_group(const float *x, long n, int16_t *lo, int16_t *hi, float *r, float *sum) {
    float buf[GROUP] = {0};
    memcpy(buf, x, n * sizeof(float));
    __m256 v[4], big = _mm256_setzero_ps(), absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int nan = 0;
    for (int k = 0; k < 4; k++) {
        __m256 raw = _mm256_loadu_ps(buf + 8 * k);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(raw, raw, _CMP_UNORD_Q));
        v[k] = bf16_round8(raw);
        big = _mm256_max_ps(big, _mm256_and_ps(v[k], absmask));
    }
    float largest = hmax(big);
    if (nan || isinf(largest)) {
        memset(lo, 0, 16 * sizeof(int16_t));
        memset(hi, 0, 16 * sizeof(int16_t));
        *r = *sum = NAN;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &largest, 4);
    int e = (int)(bits >> 23) - 127; /* 2^e <= largest < 2^(e + 1) */
    if (e < -113) {
        memset(lo, 0, 16 * sizeof(int16_t));
        memset(hi, 0, 16 * sizeof(int16_t));
        *r = *sum = 0.0f;
        return;
    }
    uint32_t up = (uint32_t)(127 + 14 - e) << 23, down = (uint32_t)(127 - 14 + e) << 23;
    float to_q, from_q;
    memcpy(&to_q, &up, 4);
    memcpy(&from_q, &down, 4);
    __m256i total = _mm256_setzero_si256();
    for (int k = 0; k < 4; k += 2) {
        /* exact products (powers of two), so the conversion rounds only what 16 bits cannot hold */
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(to_q)));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[k + 1], _mm256_set1_ps(to_q)));
        total = _mm256_add_epi32(total, _mm256_add_epi32(a, b));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
        _mm256_storeu_si256((__m256i *)(k ? hi : lo), packed);
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *r = from_q;
    *sum = (float)_mm_cvtsi128_si32(t) * from_q; /* |sum q| < 2^20: exact */
}

struct prepared {
    const int16_t *q; /* [rows, groups * 32] */
    const float *r, *sum; /* [rows, padded groups], 0 past the last group */
    long stride, pg;
};

static struct prepared prepare(const float *x, long rows, long in, float *scratch) {
    long groups = groups_of(in), pg = padded_groups(in), stride = row_values(in);
    int16_t *q = (int16_t *)scratch;
    float *r = scratch + rows * stride / 2, *sum = r + rows * pg;
    for (long row = 0; row < rows; row++) {
        int16_t *qr = q + row * stride;
        for (long g = 0; g < pg; g++) {
            long at = row * pg + g;
            if (g < groups) {
                long n = in - g * GROUP < GROUP ? in - g * GROUP : GROUP;
                prepare_group(x + row * in + g * GROUP, n, (int16_t *)half(qr, g, 0), (int16_t *)half(qr, g, 1),
                              r + at, sum + at);
            } else
                r[at] = sum[at] = 0.0f;
        }
        if (groups & 1) { /* the last pair's missing group */
            memset((int16_t *)half(qr, groups, 0), 0, 16 * sizeof(int16_t));
            memset((int16_t *)half(qr, groups, 1), 0, 16 * sizeof(int16_t));
        }
    }
    return (struct prepared){q, r, sum, stride, pg};
}


/* sum(code q) of a group, as 8 int32 lanes: 16 codes widened to 16-bit lanes (lo, hi) times the
 * group's two halves of q: at q and q + 32 (a pair of groups' values from q, the second group's
 * from q + 16) */
#define PAIR_SUMS(lo, hi, q) \
    _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(q))), \
                     _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)((q) + 32))))

/* Each row keeps two 8-lane accumulators, one over its even groups and one over its odd ones, added
 * at the end: (even + odd) + the offsets' part, then the 8 lanes in halves. The 512-bit kernels below
 * hold the two in one register's halves and take two groups an instruction; their integer lanes hold
 * the same exact sums, so both give the same bits. */

/* group g's part of rows a and b (two: 1), int4, 256-bit: acc_a += (sum of code q) fa, and for b */
static inline void q4_group(const uint8_t *c, const int16_t *qa, const int16_t *qb, const float *fa,
                            const float *fb, int two, __m256 *acc_a, __m256 *acc_b) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)c));
    __m256i lo = _mm256_and_si256(w, _mm256_set1_epi16(15)), hi = _mm256_srli_epi16(w, 4);
    *acc_a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR_SUMS(lo, hi, qa)), _mm256_broadcast_ss(fa), *acc_a);
    if (two) *acc_b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PAIR_SUMS(lo, hi, qb)), _mm256_broadcast_ss(fb), *acc_b);
}

/* output o of rows r and r + 1 (two: 1), int4, 256-bit */
static inline void q4_output(const struct prepared *p, const uint8_t *codes, const uint16_t *scales,
                             const uint16_t *offsets, long in, long o, long r, int two, float *ya, float *yb) {
    long groups = in / GROUP;
    const uint8_t *c = codes + o * in / 2;
    const uint16_t *s = scales + o * groups, *z = offsets + o * groups;
    const int16_t *qa = p->q + r * p->stride, *qb = qa + p->stride;
    const float *ra = p->r + r * p->pg, *rb = ra + p->pg, *sa = p->sum + r * p->pg, *sb = sa + p->pg;
    __m256 even_a = _mm256_setzero_ps(), odd_a = even_a, even_b = even_a, odd_b = even_a;
    __m256 zero_a = even_a, zero_b = even_a;
    float fa[8], fb[8] = {0};
    for (long g0 = 0; g0 < groups; g0 += 8) {
        /* a block of 8 groups' scales and offsets (the arrays are readable past the last output;
         * the sums and powers past the last group are 0) */
        __m256 s8 = bf16x8(s + g0), m8 = _mm256_fmadd_ps(s8, _mm256_set1_ps(-8.0f), bf16x8(z + g0));
        zero_a = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sa + g0), zero_a);
        _mm256_storeu_ps(fa, _mm256_mul_ps(s8, _mm256_loadu_ps(ra + g0)));
        if (two) {
            zero_b = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sb + g0), zero_b);
            _mm256_storeu_ps(fb, _mm256_mul_ps(s8, _mm256_loadu_ps(rb + g0)));
        }
        long n = groups - g0 < 8 ? groups - g0 : 8;
        if (ahead) {
            _mm_prefetch((const char *)(s + g0) + ahead / 4, _MM_HINT_T0);
            _mm_prefetch((const char *)(z + g0) + ahead / 4, _MM_HINT_T0);
        }
        for (long j = 0; j < n; j += 2) {
            long g = g0 + j; /* even */
            const int16_t *pa = qa + g * GROUP, *pb = qb + g * GROUP;
            if (ahead && !(g & 3)) _mm_prefetch((const char *)(c + g * 16) + ahead, _MM_HINT_T0);
            q4_group(c + g * 16, pa, pb, fa + j, fb + j, two, &even_a, &even_b);
            if (j + 1 < n) q4_group(c + g * 16 + 16, pa + 16, pb + 16, fa + j + 1, fb + j + 1, two, &odd_a, &odd_b);
        }
    }
    *ya = hsum(_mm256_add_ps(_mm256_add_ps(even_a, odd_a), zero_a));
    if (two) *yb = hsum(_mm256_add_ps(_mm256_add_ps(even_b, odd_b), zero_b));
}

/* sum(code q) of int8 rows' group g (a whole one), for rows a and b (two: 1), 256-bit */
static inline void q8_group(const int8_t *w, const int16_t *qa, const int16_t *qb, long g, int two, __m256 *ta,
                            __m256 *tb) {
    if (ahead && !(g & 1)) _mm_prefetch((const char *)(w + g * GROUP) + ahead / 2, _MM_HINT_T0);
    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + g * GROUP)));
    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + g * GROUP + 16)));
    *ta = _mm256_cvtepi32_ps(PAIR_SUMS(w0, w1, half(qa, g, 0)));
    if (two) *tb = _mm256_cvtepi32_ps(PAIR_SUMS(w0, w1, half(qb, g, 0)));
}

/* sum(code x) of the inputs past the last whole group of an int8 weight row, in order */
static inline float q8_tail(const int8_t *w, const int16_t *q, const float *r, long in) {
    long g = in / GROUP, sum = 0;
    if (g * GROUP == in) return 0.0f;
    for (long i = g * GROUP; i < in; i++) {
        long j = i - g * GROUP;
        sum += (long)w[i] * half(q, g, j >= 16)[j & 15];
    }
    return (float)sum * r[g];
}

/* output o of rows r and r + 1 (two: 1), int8, before its scale, 256-bit */
static inline void q8_output(const struct prepared *p, const int8_t *w, long in, long o, long r, int two,
                             float *ya, float *yb) {
    const int8_t *wo = w + o * in;
    const int16_t *qa = p->q + r * p->stride, *qb = qa + p->stride;
    const float *ra = p->r + r * p->pg, *rb = ra + p->pg;
    __m256 even_a = _mm256_setzero_ps(), odd_a = even_a, even_b = even_a, odd_b = even_a, ta, tb;
    long whole = in / GROUP;
    for (long g = 0; g < whole; g += 2) {
        q8_group(wo, qa, qb, g, two, &ta, &tb);
        even_a = _mm256_fmadd_ps(ta, _mm256_broadcast_ss(ra + g), even_a);
        if (two) even_b = _mm256_fmadd_ps(tb, _mm256_broadcast_ss(rb + g), even_b);
        if (g + 1 == whole) break;
        q8_group(wo, qa, qb, g + 1, two, &ta, &tb);
        odd_a = _mm256_fmadd_ps(ta, _mm256_broadcast_ss(ra + g + 1), odd_a);
        if (two) odd_b = _mm256_fmadd_ps(tb, _mm256_broadcast_ss(rb + g + 1), odd_b);
    }
    *ya = hsum(_mm256_add_ps(even_a, odd_a)) + q8_tail(wo, qa, ra, in);
    if (two) *yb = hsum(_mm256_add_ps(even_b, odd_b)) + q8_tail(wo, qb, rb, in);
}

/* The 512-bit kernels (AVX-512 BW and VNNI: vpdpwssd adds a lane's two 16-bit products to it in one
 * instruction), for CPUs that have them (feedback_quant_wide). */
#define WIDE __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* the 16 int32 lanes of two groups' sums of code q (lanes 0..7 the first group, 8..15 the second),
 * codes lo and hi as 32 16-bit lanes, q the pair's prepared values */
WIDE static inline __m512 pair_sums512(__m512i lo, __m512i hi, const int16_t *q) {
    __m512i t = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q));
    return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(t, hi, _mm512_loadu_si512(q + 32)));
}

/* lanes 0..7 f[0], 8..15 f[1] */
WIDE static inline __m512 two_factors(const float *f) {
    return _mm512_insertf32x8(_mm512_set1_ps(f[0]), _mm256_set1_ps(f[1]), 1);
}

/* (even + odd) halves of a 512-bit accumulator, + zero, as hsum adds them */
WIDE static inline float finish512(__m512 acc, __m256 zero) {
    __m256 even = _mm512_castps512_ps256(acc), odd = _mm512_extractf32x8_ps(acc, 1);
    return hsum(_mm256_add_ps(_mm256_add_ps(even, odd), zero));
}

/* q4_output, two groups an instruction. Its block setup repeats q4_output's: the two sharing one
 * inline function measured the 256-bit loop ~10 % slower at one row (the same operations; the
 * compiler laid the loop out otherwise), so each keeps its own. */
WIDE static void q4_output512(const struct prepared *p, const uint8_t *codes, const uint16_t *scales,
                              const uint16_t *offsets, long in, long o, long r, int two, float *ya, float *yb) {
    long groups = in / GROUP;
    const uint8_t *c = codes + o * in / 2;
    const uint16_t *s = scales + o * groups, *z = offsets + o * groups;
    const int16_t *qa = p->q + r * p->stride, *qb = qa + p->stride;
    const float *ra = p->r + r * p->pg, *rb = ra + p->pg, *sa = p->sum + r * p->pg, *sb = sa + p->pg;
    const __m512i low = _mm512_set1_epi16(15);
    __m512 acc_a = _mm512_setzero_ps(), acc_b = acc_a;
    __m256 zero_a = _mm256_setzero_ps(), zero_b = zero_a;
    float fa[8], fb[8];
    for (long g0 = 0; g0 < groups; g0 += 8) {
        __m256 s8 = bf16x8(s + g0), m8 = _mm256_fmadd_ps(s8, _mm256_set1_ps(-8.0f), bf16x8(z + g0));
        zero_a = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sa + g0), zero_a);
        _mm256_storeu_ps(fa, _mm256_mul_ps(s8, _mm256_loadu_ps(ra + g0)));
        if (two) {
            zero_b = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sb + g0), zero_b);
            _mm256_storeu_ps(fb, _mm256_mul_ps(s8, _mm256_loadu_ps(rb + g0)));
        }
        long n = groups - g0 < 8 ? groups - g0 : 8;
        if (ahead) {
            _mm_prefetch((const char *)(s + g0) + ahead / 4, _MM_HINT_T0);
            _mm_prefetch((const char *)(z + g0) + ahead / 4, _MM_HINT_T0);
        }
        for (long j = 0; j < n; j += 2) {
            long g = g0 + j;
            if (ahead && !(g & 3)) _mm_prefetch((const char *)(c + g * 16) + ahead, _MM_HINT_T0);
            /* two groups' 32 bytes, or the last (odd) group's 16 and zeros */
            __m256i bytes = j + 1 < n ? _mm256_loadu_si256((const __m256i *)(c + g * 16))
                                      : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(c + g * 16)));
            __m512i w = _mm512_cvtepu8_epi16(bytes);
            __m512i lo = _mm512_and_si512(w, low), hi = _mm512_srli_epi16(w, 4);
            __mmask16 lanes = j + 1 < n ? 0xffff : 0x00ff;
            __m512 ta = pair_sums512(lo, hi, qa + g * GROUP);
            acc_a = _mm512_mask3_fmadd_ps(ta, two_factors(fa + j), acc_a, lanes);
            if (two) {
                __m512 tb = pair_sums512(lo, hi, qb + g * GROUP);
                acc_b = _mm512_mask3_fmadd_ps(tb, two_factors(fb + j), acc_b, lanes);
            }
        }
    }
    *ya = finish512(acc_a, zero_a);
    if (two) *yb = finish512(acc_b, zero_b);
}

/* q8_output, two groups an instruction */
WIDE static void q8_output512(const struct prepared *p, const int8_t *w, long in, long o, long r, int two,
                              float *ya, float *yb) {
    const int8_t *wo = w + o * in;
    const int16_t *qa = p->q + r * p->stride, *qb = qa + p->stride;
    const float *ra = p->r + r * p->pg, *rb = ra + p->pg;
    long whole = in / GROUP;
    __m512 acc_a = _mm512_setzero_ps(), acc_b = acc_a;
    for (long g = 0; g < whole; g += 2) {
        const int8_t *at = wo + g * GROUP;
        if (ahead) _mm_prefetch((const char *)at + ahead / 2, _MM_HINT_T0);
        /* the pair's first halves, then its second halves (zeros for the missing group of an odd
         * last one) */
        int both = g + 1 < whole;
        __m128i a0 = _mm_loadu_si128((const __m128i *)at), a1 = _mm_loadu_si128((const __m128i *)(at + 16));
        __m128i b0 = both ? _mm_loadu_si128((const __m128i *)(at + GROUP)) : _mm_setzero_si128();
        __m128i b1 = both ? _mm_loadu_si128((const __m128i *)(at + GROUP + 16)) : _mm_setzero_si128();
        __m512i lo = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(a0), b0, 1));
        __m512i hi = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(a1), b1, 1));
        __mmask16 lanes = both ? 0xffff : 0x00ff;
        float fa[2] = {ra[g], both ? ra[g + 1] : 0.0f};
        acc_a = _mm512_mask3_fmadd_ps(pair_sums512(lo, hi, qa + g * GROUP), two_factors(fa), acc_a, lanes);
        if (two) {
            float fb[2] = {rb[g], both ? rb[g + 1] : 0.0f};
            acc_b = _mm512_mask3_fmadd_ps(pair_sums512(lo, hi, qb + g * GROUP), two_factors(fb), acc_b, lanes);
        }
    }
    __m256 none = _mm256_setzero_ps();
    *ya = finish512(acc_a, none) + q8_tail(wo, qa, ra, in);
    if (two) *yb = finish512(acc_b, none) + q8_tail(wo, qb, rb, in);
}

/* Whether the CPU has the 512-bit kernels' instructions. Where it does, the loader times them against
 * the 256-bit ones (`linear.choose_ahead`); the results are the same bits either way. */
static int wide_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        __builtin_cpu_init();
        usable = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                 __builtin_cpu_supports("avx512vnni");
    }
    return usable;
}

/* the rows from which the 512-bit kernels run (0: never; -1: not set, so from 2 where usable: at one
 * row the step is bound by reading the weights and they gained nothing in the measurements) */
static long wide_from = -1;

int feedback_quant_wide_usable(void) { return wide_usable(); }

/* Sets from how many rows the 512-bit kernels run (0: never; -1 leaves it) and returns it. */
long feedback_quant_wide(long from) {
    if (from >= 0) wide_from = wide_usable() ? from : 0;
    return wide_from < 0 ? (wide_usable() ? 2 : 0) : wide_from;
}

static inline void finish(float *y, float v, const float *b, long o) { *y = bf16_round(v) + (b ? b[o] : 0.0f); }

static void q4_outputs(const struct prepared *p, const uint8_t *codes, const uint16_t *scales,
                       const uint16_t *offsets, const float *b, float *y, long rows, long in, long out, long o,
                       int w512) {
    for (long r = 0; r < rows; r += 2) {
        float u, v = 0.0f;
        int two = r + 1 < rows;
        if (w512)
            q4_output512(p, codes, scales, offsets, in, o, r, two, &u, &v);
        else
            q4_output(p, codes, scales, offsets, in, o, r, two, &u, &v);
        finish(y + r * out + o, u, b, o);
        if (two) finish(y + (r + 1) * out + o, v, b, o);
    }
}

static void q8_outputs(const struct prepared *p, const int8_t *w, const uint16_t *scales, const float *b, float *y,
                       long rows, long in, long out, long o, int w512) {
    uint32_t bits = (uint32_t)scales[o] << 16;
    float s;
    memcpy(&s, &bits, 4);
    for (long r = 0; r < rows; r += 2) {
        float u, v = 0.0f;
        int two = r + 1 < rows;
        if (w512)
            q8_output512(p, w, in, o, r, two, &u, &v);
        else
            q8_output(p, w, in, o, r, two, &u, &v);
        finish(y + r * out + o, u * s, b, o);
        if (two) finish(y + (r + 1) * out + o, v * s, b, o);
    }
}

/* y[rows, out] = x[rows, in] W^T (+ b[out]) for int4 weights (codes [out, in / 2], scales and
 * offsets [out, in / 32] bf16 patterns, each array readable 8 patterns past its end); in a multiple
 * of 32. scratch: feedback_product_scratch(rows, in) floats. */
void feedback_q4_gemv(const float *x, const uint8_t *codes, const uint16_t *scales, const uint16_t *offsets,
                      const float *b, float *y, long rows, long in, long out, float *scratch, int threads) {
    struct prepared p = prepare(x, rows, in, scratch);
    long from = feedback_quant_wide(-1);
    int w512 = from && rows >= from;
    if (threads <= 1 || out * in < 131072) {
        for (long o = 0; o < out; o++) q4_outputs(&p, codes, scales, offsets, b, y, rows, in, out, o, w512);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < out; o++) q4_outputs(&p, codes, scales, offsets, b, y, rows, in, out, o, w512);
}

/* y[rows, out] = x[rows, in] W^T (+ b[out]) for int8 weights w [out, in] with one bf16 scale per
 * output (scales: bf16 patterns). scratch: feedback_product_scratch(rows, in) floats. */
void feedback_q8_gemv(const float *x, const int8_t *w, const uint16_t *scales, const float *b, float *y, long rows,
                      long in, long out, float *scratch, int threads) {
    struct prepared p = prepare(x, rows, in, scratch);
    long from = feedback_quant_wide(-1);
    int w512 = from && rows >= from;
    if (threads <= 1 || out * in < 131072) {
        for (long o = 0; o < out; o++) q8_outputs(&p, w, scales, b, y, rows, in, out, o, w512);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < out; o++) q8_outputs(&p, w, scales, b, y, rows, in, out, o, w512);
}

/* y[rows, out] = x[rows, in] W^T (+ b) by m's kernel. */
void feedback_product(const struct feedback_matrix *m, const float *x, float *y, long rows, long in, long out,
                      float *scratch, int threads) {
    if (m->kind == 4)
        feedback_q4_gemv(x, m->w, m->s, m->z, m->b, y, rows, in, out, scratch, threads);
    else if (m->kind == 8)
        feedback_q8_gemv(x, m->w, m->s, m->b, y, rows, in, out, scratch, threads);
    else
        feedback_gemv(x, m->w, m->b, y, rows, in, out, threads);
}
