/* The exact attention's weighted sums in float64 tiles (included by attn16.c; the build key reads
 * this header too): integer products and sums below 2^53, exact in any order. */
#ifndef SELFSPEC_ATTN16_TILES_H
#define SELFSPEC_ATTN16_TILES_H
#include <stdint.h>
#include <string.h>
#include "attn16_int.h"

#if defined(__AVX2__)
#include <immintrin.h>
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
#endif


#if defined(__AVX2__)
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
#endif

#if defined(__AVX2__)
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

#if defined(__AVX512F__)
/* Weighted values of n <= Q queries (weights p [n, S], rows S apart), dimensions d .. d + 16 B - 1
 * -> out [n, D] at those columns: 2 B Q sums of eight in registers, each key's values converted
 * and scaled once for the Q queries (a tile of twelve reuses them twelve times: wide rounds, where
 * torch's float64 GEMM of this skinny shape ran at half this speed). A one-token round's three
 * queries take 32 dimensions a task (half the per-key work of 16, and still a task per thread)
 * and skip a key all three give weight 0. Exact integer sums: the same bits as the loop in
 * attn16_pv. Q and B are constants at each call, so the loops over them unroll into registers. */
static inline __attribute__((always_inline)) void pv_zmm(const double *p, int64_t n, const int Q, const int B,
                                                         int64_t S, int64_t D, int64_t d, const int16_t *vh,
                                                         const int8_t *sh, double *out) {
    const double *pr[12];
    __m512d a[12][4];
    for (int u = 0; u < Q; u++) {
        pr[u] = p + (u < n ? u : 0) * S;
        for (int t = 0; t < 2 * B; t++) a[u][t] = _mm512_setzero_pd();
    }
    for (int64_t j = 0; j < S; j++) {
        if (Q <= 3) {
            double any = 0.0;
            for (int u = 0; u < Q; u++) any += pr[u][j];  /* weights are >= 0: a zero sum is all zeros */
            if (any == 0.0) continue;
        }
        __m512d sc = _mm512_set1_pd(pow2(sh[j])), x[4];
        for (int b = 0; b < B; b++) {
            __m512i v32 = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(vh + j * D + d + 16 * b)));
            x[2 * b] = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(v32)), sc);
            x[2 * b + 1] = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(v32, 1)), sc);
        }
        for (int u = 0; u < Q; u++) {
            __m512d y = _mm512_set1_pd(pr[u][j]);
            for (int t = 0; t < 2 * B; t++) a[u][t] = _mm512_fmadd_pd(y, x[t], a[u][t]);
        }
    }
    for (int u = 0; u < n; u++)
        for (int t = 0; t < 2 * B; t++) _mm512_storeu_pd(out + u * D + d + 8 * t, a[u][t]);
}

#endif


#if defined(__AVX512F__)
/* dimensions d .. d + bw - 1 (16, or 32 where n <= 3) of n <= 12 queries' weighted values */
static void pv_tile(const double *p, int64_t n, int64_t bw, int64_t S, int64_t D, int64_t d, const int16_t *vh,
                    const int8_t *sh, double *out) {
    if (bw == 32) pv_zmm(p, n, 3, 2, S, D, d, vh, sh, out);
    else if (n <= 3) pv_zmm(p, n, 3, 1, S, D, d, vh, sh, out);
    else if (n <= 6) pv_zmm(p, n, 6, 1, S, D, d, vh, sh, out);
    else if (n <= 9) pv_zmm(p, n, 9, 1, S, D, d, vh, sh, out);
    else pv_zmm(p, n, 12, 1, S, D, d, vh, sh, out);
}
#endif

#endif
