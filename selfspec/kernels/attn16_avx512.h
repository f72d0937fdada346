/* The exact attention's loops with AVX-512: a D = 64 key row in two vectors for the scores (F and
 * BW; with VNNI the products and sums in one instruction), and the weighted values in float64
 * tiles of up to twelve queries (F). The same integer sums as the AVX2 and plain loops: the same
 * bits. Many query rows a key head take attn16_keytiles.h's loop; the integer weighted sums are
 * attn16_words.h's. */
#ifndef SELFSPEC_ATTN16_AVX512_H
#define SELFSPEC_ATTN16_AVX512_H
#include "attn16_avx2.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* a + the pair sums of y x (sixteen int32 lanes), as dot_acc */
static inline __m512i dot_acc512(__m512i a, __m512i y, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(a, y, x);
#else
    return _mm512_add_epi32(a, _mm512_madd_epi16(y, x));
#endif
}

/* [sum a0, sum a1, sum a2, sum a3] of four vectors of sixteen int32 (exact: the sums stay below 2^31) */
static inline __m128i hsum4_epi32x16(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    __m256i y = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
}

/* scores_i16_by4 with 512-bit vectors for D == 64: a key row is two vectors, so a score costs two
 * instructions and a quarter of a four-way reduction; up to three query rows (a one-token round's
 * heads of one key head) stay in registers across the keys, more are read three at a time for every
 * four keys. The same integer sums, so the same bits. Returns the first key it left. */
static inline __attribute__((always_inline)) int64_t scores_z64(const int16_t *qi, const int8_t *qs, int64_t G,
                                                                const void *kh, const void *sh, int64_t j, int64_t j1,
                                                                int64_t S, double *out, const int kb) {
    const int64_t D = 64;
    __m512i q[3][2];
    for (int u = 0; u < 3; u++) {  /* up to three rows: held for the whole block of keys */
        int64_t i = u < G ? u : 0;
        q[u][0] = _mm512_loadu_si512((const void *)(qi + i * D));
        q[u][1] = _mm512_loadu_si512((const void *)(qi + i * D + 32));
    }
    for (; j + 4 <= j1; j += 4) {
        __m256d fk = key_x4(sh, j, kb);
        for (int v = 0; v < 4 * kb; v++)  /* the keys 32 ahead: one line a key row of int8, two of int16 */
            _mm_prefetch((const char *)kh + (j + 32) * D * kb + 64 * v, _MM_HINT_T0);
        __m512i x[4][2];
        for (int v = 0; v < 4; v++)  /* a one-byte cache's keys widened as they are loaded */
            for (int c = 0; c < 2; c++)
                x[v][c] = kb == 1 ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                        (const __m256i *)((const int8_t *)kh + (j + v) * D + 32 * c)))
                                  : _mm512_loadu_si512((const void *)((const int16_t *)kh + (j + v) * D + 32 * c));
        for (int64_t i0 = 0; i0 < G; i0 += 3) {
            if (G > 3)  /* more: three at a time for every four keys */
                for (int u = 0; u < 3; u++) {
                    int64_t i = i0 + u < G ? i0 + u : i0;
                    q[u][0] = _mm512_loadu_si512((const void *)(qi + i * D));
                    q[u][1] = _mm512_loadu_si512((const void *)(qi + i * D + 32));
                }
            __m512i a[3][4];
            for (int u = 0; u < 3; u++)
                for (int v = 0; v < 4; v++)
                    a[u][v] = dot_acc512(dot_acc512(_mm512_setzero_si512(), q[u][0], x[v][0]), q[u][1], x[v][1]);
            for (int u = 0; u < 3 && i0 + u < G; u++)
                store_scores4(out + (i0 + u) * S + j, hsum4_epi32x16(a[u][0], a[u][1], a[u][2], a[u][3]), fk,
                              qs[i0 + u]);
        }
    }
    return j;
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
