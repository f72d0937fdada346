/* The exact attention's loops with AVX2 (also what the AVX-512 loops fall back to for a block's
 * last keys): scores as int16 dot products, four keys by three query rows at a time, and the
 * weighted values in float64, eight or sixteen dimensions a task. Every sum is of integers below
 * 2^53 (2^31 for the int32 ones), exact in any order: the bits of attn16.c's plain loops. */
#ifndef SELFSPEC_ATTN16_AVX2_H
#define SELFSPEC_ATTN16_AVX2_H
#include "attn16.h"

#if defined(__AVX2__)
/* [sum a0, sum a1, sum a2, sum a3] of four vectors of eight int32 (exact: the sums stay below 2^31) */
static inline __m128i hsum4_epi32(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* a + the pair sums of y x (eight int32 lanes): one VNNI instruction where the CPU has it; vpdpwssd
 * does not saturate, so both are the same exact integer sums */
static inline __m256i dot_acc(__m256i a, __m256i y, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(a, y, x);
#else
    return _mm256_add_epi32(a, _mm256_madd_epi16(y, x));
#endif
}

/* the four keys' 2^shift from their shifts sh[0..3], built from the exponent bits (exact) */
static inline __m256d pow2_x4(const int8_t *sh) {
    int32_t e4;
    memcpy(&e4, sh, 4);
    return _mm256_castsi256_pd(_mm256_slli_epi64(
        _mm256_add_epi64(_mm256_cvtepi8_epi64(_mm_cvtsi32_si128(e4)), _mm256_set1_epi64x(1023)), 52));
}

/* the four keys' integer scales c[0..3] (a one-byte cache's K) as doubles (exact) */
static inline __m256d scale_x4(const int32_t *c) {
    return _mm256_cvtepi32_pd(_mm_loadu_si128((const __m128i *)c));
}

/* four keys' factors: 2^shift (int16 K) or the integer scale (kb == 1: the one-byte cache's K) */
static inline __attribute__((always_inline)) __m256d key_x4(const void *sh, int64_t j, const int kb) {
    return kb == 1 ? scale_x4((const int32_t *)sh + j) : pow2_x4((const int8_t *)sh + j);
}

/* four scores of one query row: the integer sums times the keys' factors (2^shift_k, or an integer
 * scale: products below 2^53), then 2^qs: exact, so the bits of the float64 sums of the rounded
 * row times the keys' values */
static inline void store_scores4(double *out, __m128i sums, __m256d fk, int8_t qs) {
    __m256d s = _mm256_cvtepi32_pd(sums);
    _mm256_storeu_pd(out, _mm256_mul_pd(_mm256_mul_pd(s, fk), _mm256_set1_pd(pow2(qs))));
}

/* scores of keys j .. j1 - 1, four at a time, for G queries three at a time: twelve int32 vector
 * sums of sixteen products each step (D % 16 == 0). Returns the first key it left. */
static inline __attribute__((always_inline)) int64_t scores_by4(const int16_t *qi, const int8_t *qs, int64_t G,
                                                                int64_t D, const void *kh, const void *sh, int64_t j,
                                                                int64_t j1, int64_t S, double *out, const int kb) {
    for (; j + 4 <= j1; j += 4) {
        __m256d fk = key_x4(sh, j, kb);
        for (int64_t i0 = 0; i0 < G; i0 += 3) {
            const int16_t *q0 = qi + i0 * D, *q1 = qi + (i0 + 1 < G ? i0 + 1 : i0) * D,
                          *q2 = qi + (i0 + 2 < G ? i0 + 2 : i0) * D;
            __m256i a[3][4];
            for (int u = 0; u < 3; u++) for (int v = 0; v < 4; v++) a[u][v] = _mm256_setzero_si256();
            for (int64_t d = 0; d < D; d += 16) {
                __m256i x[4], y[3];
                for (int v = 0; v < 4; v++)  /* a one-byte cache's keys widened as they are loaded */
                    x[v] = kb == 1 ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((const int8_t *)kh + (j + v) * D + d)))
                                   : _mm256_loadu_si256((const __m256i *)((const int16_t *)kh + (j + v) * D + d));
                y[0] = _mm256_loadu_si256((const __m256i *)(q0 + d));
                y[1] = _mm256_loadu_si256((const __m256i *)(q1 + d));
                y[2] = _mm256_loadu_si256((const __m256i *)(q2 + d));
                for (int u = 0; u < 3; u++)
                    for (int v = 0; v < 4; v++) a[u][v] = dot_acc(a[u][v], y[u], x[v]);
            }
            for (int u = 0; u < 3 && i0 + u < G; u++)
                store_scores4(out + (i0 + u) * S + j, hsum4_epi32(a[u][0], a[u][1], a[u][2], a[u][3]), fk, qs[i0 + u]);
        }
    }
    return j;
}

/* a + x y: one fused instruction where the CPU has it. Exact either way (integer products and sums
 * below 2^53 round nowhere), so the same bits; -ffp-contract=off only keeps the exponential's
 * order, which never comes here. */
static inline __m256d madd(__m256d a, __m256d x, __m256d y) {
#if defined(__FMA__)
    return _mm256_fmadd_pd(x, y, a);
#else
    return _mm256_add_pd(a, _mm256_mul_pd(x, y));
#endif
}

/* Weighted values of n <= QCHUNK queries (weights p [n, S], rows S apart) -> out [n, D]: eight
 * values at a time for all n queries in registers, each key's eight values converted once; a key
 * every query gives weight 0 (masked, or below half a unit) is skipped. Exact integer sums: the
 * same bits as the loop in attn16_pv. */
static void pv_by8(const double *p, int64_t n, int64_t S, int64_t D, const int16_t *vh, const int8_t *sh,
                   double *out) {
    const double *p0 = p, *p1 = p + (n > 1 ? 1 : 0) * S, *p2 = p + (n > 2 ? 2 : 0) * S, *p3 = p + (n > 3 ? 3 : 0) * S;
    for (int64_t d = 0; d < D; d += 8) {
        __m256d a[4][2];
        for (int u = 0; u < 4; u++) a[u][0] = a[u][1] = _mm256_setzero_pd();
        for (int64_t j = 0; j < S; j++) {
            double w0 = p0[j], w1 = p1[j], w2 = p2[j], w3 = p3[j];
            if (w0 == 0.0 && w1 == 0.0 && w2 == 0.0 && w3 == 0.0) continue;
            const int16_t *vj = vh + j * D + d;
            __m256d sc = _mm256_set1_pd(pow2(sh[j]));
            __m256d x0 = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i *)vj))), sc);
            __m256d x1 = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i *)(vj + 4)))), sc);
            __m256d y[4] = {_mm256_set1_pd(w0), _mm256_set1_pd(w1), _mm256_set1_pd(w2), _mm256_set1_pd(w3)};
            for (int u = 0; u < 4; u++) {
                a[u][0] = madd(a[u][0], y[u], x0);
                a[u][1] = madd(a[u][1], y[u], x1);
            }
        }
        for (int u = 0; u < n; u++) {
            _mm256_storeu_pd(out + u * D + d, a[u][0]);
            _mm256_storeu_pd(out + u * D + d + 4, a[u][1]);
        }
    }
}

/* Weighted values of n <= 3 queries (weights p [n, S], rows S apart), dimensions d .. d + 15 ->
 * out [n, D] at those columns: twelve sums in registers, each key's sixteen values converted and
 * scaled once for the three queries; a key every query gives weight 0 is skipped. A task is one
 * block of sixteen dimensions, so a one-token round's three queries per key head still split
 * across the threads. Exact integer sums: the same bits as the loop in attn16_pv. */
static inline __attribute__((always_inline)) void pv_by16_of(const double *p, int64_t n, int64_t S, int64_t D,
                                                             int64_t d, const void *vh, const int8_t *sh, double *out,
                                                             const int kb) {
    const double *p0 = p, *p1 = p + (n > 1 ? 1 : 0) * S, *p2 = p + (n > 2 ? 2 : 0) * S;
    __m256d a[3][4];
    for (int u = 0; u < 3; u++) for (int t = 0; t < 4; t++) a[u][t] = _mm256_setzero_pd();
    for (int64_t j = 0; j < S; j++) {
        double w0 = p0[j], w1 = p1[j], w2 = p2[j];
        if (w0 == 0.0 && w1 == 0.0 && w2 == 0.0) continue;
        __m256d sc = _mm256_set1_pd(pow2(sh[j]));
        __m256d x[4];
        for (int t = 0; t < 4; t++) {  /* a one-byte cache's values widened as they are loaded */
            int64_t at = j * D + d + 4 * t;
            int32_t b4;
            if (kb == 1) memcpy(&b4, (const int8_t *)vh + at, 4);
            __m128i i4 = kb == 1 ? _mm_cvtepi8_epi32(_mm_cvtsi32_si128(b4))
                                 : _mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i *)((const int16_t *)vh + at)));
            x[t] = _mm256_mul_pd(_mm256_cvtepi32_pd(i4), sc);
        }
        __m256d y[3] = {_mm256_set1_pd(w0), _mm256_set1_pd(w1), _mm256_set1_pd(w2)};
        for (int u = 0; u < 3; u++)
            for (int t = 0; t < 4; t++) a[u][t] = madd(a[u][t], y[u], x[t]);
    }
    for (int u = 0; u < n; u++)
        for (int t = 0; t < 4; t++) _mm256_storeu_pd(out + u * D + d + 4 * t, a[u][t]);
}

static void pv_by16(const double *p, int64_t n, int64_t S, int64_t D, int64_t d, const int16_t *vh,
                    const int8_t *sh, double *out) {
    pv_by16_of(p, n, S, D, d, vh, sh, out, 2);
}

static void pv_by16_8(const double *p, int64_t n, int64_t S, int64_t D, int64_t d, const int8_t *vh,
                      const int8_t *sh, double *out) {
    pv_by16_of(p, n, S, D, d, vh, sh, out, 1);
}
#endif
#endif
