/* The exact attention's scores as integer dot products (included by attn16.c; the build key reads
 * this header too).
 *
 * A query row (one token, one head: D grid integers in float64) is rounded to a block float before
 * its scores: q = q' 2^s with s = max(0, e - QB), where 2^(e-1) <= max |q| < 2^e, and q' =
 * rint(q 2^-s), so |q'| <= 2^QB. QB = 16 - ceil(log2 D) (10 for D = 64) keeps a score's integer sum
 * below 2^31 whatever the order: |q'| |k| D <= 2^QB (2^15 - 1) D < 2^31 with k the cache's int16
 * (|k| <= 32767). So sum q'_d k_d is exact in int32 (pairs of int16 products summed by one
 * instruction), and q' k 2^(s + shift_k) is the same double as the float64 product sums of the
 * rounded q: the C loops here, the float64 loops of attn16.c and torch's float64 matmul give the same
 * bits. The rounding is a function of the row alone (the same at any width, batch or cache size);
 * what it costs in quality is measured as a weight format's is (10 bits kept the mean KL to fp32
 * within noise on real text). `kernels.attn16.round_q` is its torch twin. */
#ifndef SELFSPEC_ATTN16_INT_H
#define SELFSPEC_ATTN16_INT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline int q_bits(int64_t D) {
    int b = 0;
    while (((int64_t)1 << b) < D) b++;
    return 16 - b;
}

static inline double pow2(int e) {  /* 2^e for a normal e (|e| < 1023), exactly ldexp(1.0, e), without the call */
    union { double d; int64_t i; } t;
    t.i = ((int64_t)e + 1023) << 52;
    return t.d;
}

/* q [D] float64 grid integers -> qi [D] = rint(q 2^-s); returns s */
static inline int q_round(const double *q, int64_t D, int qb, int16_t *qi) {
    double top = 0.0;
    #pragma omp simd reduction(max:top)  /* a maximum: the same in any order */
    for (int64_t d = 0; d < D; d++) top = fabs(q[d]) > top ? fabs(q[d]) : top;
    int e = 0;
    frexp(top, &e);
    int s = e - qb > 0 ? e - qb : 0;
    double f = pow2(-s);
    for (int64_t d = 0; d < D; d++) qi[d] = (int16_t)nearbyint(q[d] * f);
    return s;
}


#if defined(__AVX2__)
#include <immintrin.h>
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
#endif

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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "attn16_keytiles.h"
#endif

/* scores of keys j .. j1 - 1 for G rounded query rows, into out [G, S]: the widest loop this CPU has,
 * then one key at a time. Keys: int16 rows kh [.., D] with shifts sh, or (kb == 1, the one-byte
 * cache) int8 rows with int32 scales. */
static inline __attribute__((always_inline)) void scores_rows_of(const int16_t *qh, const int8_t *qsh, int64_t G,
                                                                 int64_t D, const void *kh, const void *sh, int64_t j,
                                                                 int64_t j1, int64_t S, double *out, const int kb) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (D == 64 && G >= KEYTILE_G) j = scores_keytiles(qh, qsh, G, kh, sh, j, j1, S, out, kb);
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (D == 64) j = scores_z64(qh, qsh, G, kh, sh, j, j1, S, out, kb);
#endif
#if defined(__AVX2__)
    if (D % 16 == 0) j = scores_by4(qh, qsh, G, D, kh, sh, j, j1, S, out, kb);
#endif
    for (; j < j1; j++)
        for (int64_t i = 0; i < G; i++) {
            const int16_t *q = qh + i * D;
            int32_t acc = 0;  /* exact: below 2^31 */
            if (kb == 1)
                for (int64_t d = 0; d < D; d++) acc += (int32_t)q[d] * ((const int8_t *)kh)[j * D + d];
            else
                for (int64_t d = 0; d < D; d++) acc += (int32_t)q[d] * ((const int16_t *)kh)[j * D + d];
            out[i * S + j] = kb == 1 ? ((double)acc * (double)((const int32_t *)sh)[j]) * pow2(qsh[i])  /* < 2^53 */
                                     : (double)acc * pow2(qsh[i] + ((const int8_t *)sh)[j]);
        }
}

static void scores_rows(const int16_t *qh, const int8_t *qsh, int64_t G, int64_t D, const int16_t *kh,
                        const int8_t *sh, int64_t j, int64_t j1, int64_t S, double *out) {
    scores_rows_of(qh, qsh, G, D, kh, sh, j, j1, S, out, 2);
}

static void scores_rows8(const int16_t *qh, const int8_t *qsh, int64_t G, int64_t D, const int8_t *kh,
                         const int32_t *kc, int64_t j, int64_t j1, int64_t S, double *out) {
    scores_rows_of(qh, qsh, G, D, kh, kc, j, j1, S, out, 1);
}

/* The one-byte cache (kb == 1): K as int8 mantissas with an integer scale per token and key head
 * (int32: k = m c), V as int8 mantissas with a shift (v = m 2^shift). The loops widen them to int16
 * in registers as they load them; `widen8` makes a widened copy where no loop reads them. */

/* n rows of int8 src [n, D] -> int16 dst [n, D] */
static inline void widen8(const int8_t *src, int64_t n, int64_t D, int16_t *dst) {
    for (int64_t i = 0; i < n * D; i++) dst[i] = src[i];
}

/* qi [R, KV, G, D] int16 and qs [R, KV, G] (q_round's); k (int16 with int8 shifts, or where kb == 1
 * int8 with int32 scales), its factors ks and scores as attn16_scores */
static void scores_i16(const int16_t *qi, const int8_t *qs, int64_t R, int64_t KV, int64_t G, int64_t D,
                       const void *k, int64_t krs, int64_t khs, const void *ks, int64_t srs, int64_t shs,
                       int64_t S, double *scores, int threads, int64_t par_min, int kb) {
    int64_t jblock = 64, nj = (S + jblock - 1) / jblock;
    #pragma omp parallel for schedule(static) collapse(2) num_threads(threads) if (R * KV * G * S * D >= par_min)
    for (int64_t rh = 0; rh < R * KV; rh++) {
        for (int64_t jb = 0; jb < nj; jb++) {
            int64_t r = rh / KV, h = rh % KV, off = r * krs + h * khs, soff = r * srs + h * shs;
            const int16_t *qh = qi + rh * G * D;
            const int8_t *qsh = qs + rh * G;
            double *out = scores + rh * G * S;
            int64_t j = jb * jblock, j1 = (jb + 1) * jblock < S ? (jb + 1) * jblock : S;
            if (kb == 1) scores_rows8(qh, qsh, G, D, (const int8_t *)k + off, (const int32_t *)ks + soff, j, j1, S, out);
            else scores_rows(qh, qsh, G, D, (const int16_t *)k + off, (const int8_t *)ks + soff, j, j1, S, out);
        }
    }
}
#endif
