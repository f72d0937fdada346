/* The exact attention's two matmuls over the compact cache (int16 with a power-of-two shift per
 * key and head), read in place: no float64 copy of the cache is made.
 *
 *   scores[r, h, i, j] = 2^ks[r, h, j] * sum_d q[r, h, i, d] * k[r, h, j, d]
 *   out[r, h, i, d]    = sum_j p[r, h, i, j] * 2^vs[r, h, j] * v[r, h, j, d]
 *
 * Every product and partial sum is an integer below 2^53 (the attention grid's bounds,
 * `engine/attention.py`), so float64 arithmetic is exact in any order: the results are the
 * same bits as torch's float64 matmul over the decompressed cache (`selfspec/kernels/attn16.py`),
 * whatever the threads, the vector width or the order of the sums.
 *
 * attn16_weights turns a row's scores into its integer softmax weights in place (mask, scale,
 * max, exponential, rounding, their sum); its exponential is a fixed sequence of IEEE multiplies
 * and adds (built with -ffp-contract=off), which `attn16.py` repeats in torch ops, so the
 * fallback gives the same bits (libm's and torch's own exp need not agree in the last bit, and
 * torch's vector body and scalar tail need not either). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include "bf16.h"
#include "attn16_int.h"

#define D_MAX 256

#define QCHUNK 4
static int int_pv_on = 1;  /* attn16_set_int_pv */
#define PAR_MIN 262144  /* multiply-adds below which a step runs on one thread: a team costs ~10 us to wake */

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
static void pv_by16(const double *p, int64_t n, int64_t S, int64_t D, int64_t d, const int16_t *vh,
                    const int8_t *sh, double *out) {
    const double *p0 = p, *p1 = p + (n > 1 ? 1 : 0) * S, *p2 = p + (n > 2 ? 2 : 0) * S;
    __m256d a[3][4];
    for (int u = 0; u < 3; u++) for (int t = 0; t < 4; t++) a[u][t] = _mm256_setzero_pd();
    for (int64_t j = 0; j < S; j++) {
        double w0 = p0[j], w1 = p1[j], w2 = p2[j];
        if (w0 == 0.0 && w1 == 0.0 && w2 == 0.0) continue;
        const int16_t *vj = vh + j * D + d;
        __m256d sc = _mm256_set1_pd(pow2(sh[j]));
        __m256d x[4];
        for (int t = 0; t < 4; t++)
            x[t] = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i *)(vj + 4 * t)))), sc);
        __m256d y[3] = {_mm256_set1_pd(w0), _mm256_set1_pd(w1), _mm256_set1_pd(w2)};
        for (int u = 0; u < 3; u++)
            for (int t = 0; t < 4; t++) a[u][t] = madd(a[u][t], y[u], x[t]);
    }
    for (int u = 0; u < n; u++)
        for (int t = 0; t < 4; t++) _mm256_storeu_pd(out + u * D + d + 4 * t, a[u][t]);
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* The weighted sums in integers where AVX-512 VNNI is at hand: each row's weights (integers
 * 0 .. 2^20, as attn16_weights makes them) are written once as words for its pairs of keys
 * (2m, 2m + 1), the two weights' high 10-bit limbs side by side in one 32-bit word (wh) and their
 * low limbs in another (wl). A key pair then costs one instruction per limb, query and sixteen
 * dimensions, p_2m v_2m + p_2m+1 v_2m+1 summed in int32 (the two keys' values interleaved, the
 * word broadcast from memory): a quarter of the float64 tiles' instructions and none of their
 * conversions. Products are below 2^25, so a lane takes 30 pairs before it is added to a float64
 * sum; every sum is the float64 loop's exact integer, so the same bits. Where a key head's V
 * shifts differ (a real model's never did: `pv_uniform`) or a weight is no integer in 0 .. 2^20,
 * the float64 tiles run instead. */
#define PV_FLUSH 30  /* key pairs an int32 lane takes: 30 x 2 x 2^10 x 2^15 < 2^31 */
static __thread int32_t *pvw_buf = NULL;  /* the words, reused */
static __thread size_t pvw_cap = 0;
#define DPWSSD_BCAST(acc, x, m) __asm__("vpdpwssd %[xm]%{1to16%}, %[xv], %[av]" : [av] "+v"(acc) : [xv] "v"(x), [xm] "m"(m))

static int pv_uniform(const int8_t *vs, int64_t R, int64_t KV, int64_t S, int64_t srs, int64_t shs) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < KV; h++) {
            const int8_t *sh = vs + r * srs + h * shs;
            for (int64_t j = 1; j < S; j++)
                if (sh[j] != sh[0]) return 0;
        }
    return 1;
}

/* weights p [n, S] (doubles) -> wh, wl [n, ws] (ws >= (S + 1) / 2 + 8); 0 where one is no integer in 0 .. 2^20 */
/* one row's weights sr [S] -> its words whr, wlr [(S + 1) / 2 + 8]; nonzero where a weight is no
 * integer in 0 .. 2^20 */
static int row_words(const double *sr, int64_t S, int32_t *whr, int32_t *wlr) {
    const __m512i top = _mm512_set1_epi32(1 << 20), low = _mm512_set1_epi32(1023);
    int bad = 0;
    for (int64_t j = 0; j < S; j += 16) {  /* eight pairs: 16 weights */
        __mmask8 m0 = S - j >= 8 ? 0xFF : (S - j > 0 ? (__mmask8)((1u << (S - j)) - 1) : 0);
        __mmask8 m1 = S - j >= 16 ? 0xFF : (S - j > 8 ? (__mmask8)((1u << (S - j - 8)) - 1) : 0);
        __m512d p0 = _mm512_maskz_loadu_pd(m0, sr + j), p1 = _mm512_maskz_loadu_pd(m1, sr + j + 8);
        __m256i i0 = _mm512_cvtpd_epi32(p0), i1 = _mm512_cvtpd_epi32(p1);
        __m512i pi = _mm512_inserti64x4(_mm512_castsi256_si512(i0), i1, 1);
        bad |= _mm512_cmpgt_epu32_mask(pi, top) != 0;  /* < 0 or > 2^20 (NaN and overflow convert to < 0) */
        bad |= (_mm512_cmp_pd_mask(p0, _mm512_cvtepi32_pd(i0), _CMP_NEQ_UQ) |  /* a fraction */
                _mm512_cmp_pd_mask(p1, _mm512_cvtepi32_pd(i1), _CMP_NEQ_UQ)) != 0;
        __m512i limb[2] = {_mm512_srli_epi32(pi, 10), _mm512_and_si512(pi, low)};
        int32_t *dst[2] = {whr + j / 2, wlr + j / 2};
        for (int l = 0; l < 2; l++) {  /* (even | odd << 32) -> even | odd << 16 in each 64-bit lane */
            __m512i t = _mm512_or_si512(limb[l], _mm512_srli_epi64(limb[l], 16));
            _mm256_storeu_si256((__m256i *)dst[l], _mm512_cvtepi64_epi32(t));
        }
    }
    return bad;
}

/* weights p [n, S] -> wh, wl [n, ws] (ws >= (S + 1) / 2 + 8); 0 where one is no integer in 0 .. 2^20 */
static int weights_words(const double *p, int64_t n, int64_t S, int32_t *wh, int32_t *wl, int64_t ws, int threads) {
    int bad = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(|:bad) if (n * S * 4 >= PAR_MIN)
    for (int64_t row = 0; row < n; row++) bad |= row_words(p + row * S, S, wh + row * ws, wl + row * ws);
    return !bad;
}

/* the words' scratch (this thread's, reused), or NULL */
static int32_t *words_scratch(size_t need) {
    if (need > pvw_cap) {
        int32_t *b = (int32_t *)realloc(pvw_buf, need * sizeof(int32_t));
        if (!b) return NULL;
        pvw_buf = b;
        pvw_cap = need;
    }
    return pvw_buf;
}

/* n <= Q queries' weighted values (their words rows ws apart), dimensions d .. d + 31 */
static inline __attribute__((always_inline)) void pv_words_tile(const int32_t *wh, const int32_t *wl, int64_t ws,
                                                                int64_t n, const int Q, int64_t S, int64_t D, int64_t d,
                                                                const int16_t *vh, double f, double *out) {
    const int32_t *hr[6], *lr[6];
    for (int u = 0; u < Q; u++) {
        hr[u] = wh + (u < n ? u : 0) * ws;
        lr[u] = wl + (u < n ? u : 0) * ws;
    }
    int64_t np = (S + 1) / 2;
    double acc[6][2][32];  /* [query][limb][lane]: lanes 0-15 the interleave's low half, 16-31 its high */
    memset(acc, 0, sizeof acc);
    for (int64_t m0 = 0; m0 < np; m0 += PV_FLUSH) {
        int64_t m1 = m0 + PV_FLUSH < np ? m0 + PV_FLUSH : np;
        __m512i a[6][2][2];
        for (int u = 0; u < Q; u++)
            for (int l = 0; l < 2; l++) a[u][l][0] = a[u][l][1] = _mm512_setzero_si512();
        for (int64_t m = m0; m < m1; m++) {
            const int16_t *ra = vh + 2 * m * D + d, *rb = 2 * m + 1 < S ? ra + D : ra;  /* a last odd key: weight 0 */
            __m512i va = _mm512_loadu_si512((const void *)ra), vb = _mm512_loadu_si512((const void *)rb);
            __m512i x0 = _mm512_unpacklo_epi16(va, vb), x1 = _mm512_unpackhi_epi16(va, vb);
            for (int u = 0; u < Q; u++) {
                DPWSSD_BCAST(a[u][0][0], x0, hr[u][m]);
                DPWSSD_BCAST(a[u][0][1], x1, hr[u][m]);
                DPWSSD_BCAST(a[u][1][0], x0, lr[u][m]);
                DPWSSD_BCAST(a[u][1][1], x1, lr[u][m]);
            }
        }
        for (int u = 0; u < Q; u++)  /* Q, not n: a constant bound keeps a[][][] in registers */
            for (int l = 0; l < 2; l++)
                for (int h = 0; h < 2; h++) {
                    double *o = acc[u][l] + 16 * h;
                    _mm512_storeu_pd(o, _mm512_add_pd(_mm512_loadu_pd(o), _mm512_cvtepi32_pd(_mm512_castsi512_si256(a[u][l][h]))));
                    _mm512_storeu_pd(o + 8, _mm512_add_pd(_mm512_loadu_pd(o + 8),
                                                          _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a[u][l][h], 1))));
                }
    }
    for (int u = 0; u < n; u++)  /* lane i of the interleave's half h is dimension 8 (i / 4) + 4 h + i % 4 */
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 16; i++)
                out[u * D + d + 8 * (i / 4) + 4 * h + i % 4] = (acc[u][0][16 * h + i] * 1024.0 + acc[u][1][16 * h + i]) * f;
}

/* attn16_pv's sums from the words: tasks of 3 queries (a one-token round) or 6, 32 dimensions */
static void pv_words(const int32_t *wh, const int32_t *wl, int64_t ws, int64_t R, int64_t KV, int64_t G, int64_t D,
                     const int16_t *v, int64_t vrs, int64_t vhs, const int8_t *vs, int64_t srs, int64_t shs, int64_t S,
                     double *out, int threads) {
    int64_t tq = G <= 3 ? 3 : 6, ng = (G + tq - 1) / tq, nd = D / 32;
    #pragma omp parallel for schedule(static) collapse(3) num_threads(threads) if (R * KV * G * S * D >= PAR_MIN)
    for (int64_t rh = 0; rh < R * KV; rh++)
        for (int64_t qg = 0; qg < ng; qg++)
            for (int64_t db = 0; db < nd; db++) {
                int64_t r = rh / KV, h = rh % KV, i0 = tq * qg, n = G - i0 < tq ? G - i0 : tq, row = rh * G + i0;
                const int16_t *vh = v + r * vrs + h * vhs;
                double f = pow2(vs[r * srs + h * shs]);
                if (tq == 3)
                    pv_words_tile(wh + row * ws, wl + row * ws, ws, n, 3, S, D, 32 * db, vh, f, out + row * D);
                else
                    pv_words_tile(wh + row * ws, wl + row * ws, ws, n, 6, S, D, 32 * db, vh, f, out + row * D);
            }
}
#endif

/* Whether attn16_pv may take the integer path (where it exists, 1 by default); returns the previous
 * setting. For tests and A/B timing in one process: both paths give the same bits. */
int attn16_set_int_pv(int on) {
    int old = int_pv_on;
    int_pv_on = on;
    return old;
}

/* 1 where attn16_pv's tiles beat torch's float64 GEMM at every width (AVX-512: twice its speed on a
 * prefill chunk's shape), so that `attn16.weighted` runs them for wide rounds too; else 0 */
int attn16_pv_wide(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* q [R, KV, G, D] contiguous float64 grid integers; k rows at k + r*krs + h*khs + j*D (int16),
 * shifts at ks + r*srs + h*shs + j; scores [R, KV, G, S] contiguous: each query row rounded
 * (q_round) and its scores summed as int16 products (scores_i16). Returns 1 when scratch cannot
 * be had (nothing written), else 0. */
int attn16_scores(const double *q, int64_t R, int64_t KV, int64_t G, int64_t D, const int16_t *k,
                  int64_t krs, int64_t khs, const int8_t *ks, int64_t srs, int64_t shs, int64_t S,
                  double *scores, int threads) {
    int64_t n = R * KV * G;
    int16_t *qi = malloc((size_t)(n * D) * sizeof(int16_t));
    int8_t *qs = malloc((size_t)n);
    if (!qi || !qs) {
        free(qi); free(qs);
        return 1;
    }
    int qb = q_bits(D);
    for (int64_t row = 0; row < n; row++) qs[row] = (int8_t)q_round(q + row * D, D, qb, qi + row * D);
    scores_i16(qi, qs, R, KV, G, D, k, krs, khs, ks, srs, shs, S, scores, threads, PAR_MIN);
    free(qi); free(qs);
    return 0;
}

/* p [R, KV, G, S] contiguous; v like k; out [R, KV, G, D] contiguous. */
void attn16_pv(const double *p, int64_t R, int64_t KV, int64_t G, int64_t D, const int16_t *v, int64_t vrs,
               int64_t vhs, const int8_t *vs, int64_t srs, int64_t shs, int64_t S, double *out, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (int_pv_on && D % 32 == 0 && S > 0 && pv_uniform(vs, R, KV, S, srs, shs)) {
        int64_t n = R * KV * G, ws = (S + 1) / 2 + 16;
        int32_t *wh = words_scratch((size_t)(2 * n * ws));
        if (wh && weights_words(p, n, S, wh, wh + n * ws, ws, threads)) {
            pv_words(wh, wh + n * ws, ws, R, KV, G, D, v, vrs, vhs, vs, srs, shs, S, out, threads);
            return;
        }
    }
#endif
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        int64_t tq = G <= 3 ? 3 : (G <= 6 ? 6 : (G <= 9 ? 9 : 12)), ng = (G + tq - 1) / tq;
        int64_t bw = G <= 3 && D % 32 == 0 ? 32 : 16, nd = D / bw;  /* pv_tile's dimensions a task */
        #pragma omp parallel for schedule(static) collapse(3) num_threads(threads) if (R * KV * G * S * D >= PAR_MIN)
        for (int64_t rh = 0; rh < R * KV; rh++)
            for (int64_t qg = 0; qg < ng; qg++)
                for (int64_t db = 0; db < nd; db++) {
                    int64_t r = rh / KV, h = rh % KV, i0 = tq * qg, n = G - i0 < tq ? G - i0 : tq;
                    pv_tile(p + (rh * G + i0) * S, n, bw, S, D, bw * db, v + r * vrs + h * vhs, vs + r * srs + h * shs,
                            out + (rh * G + i0) * D);
                }
        return;
    }
#endif
#if defined(__AVX2__)
    if (D % 16 == 0) {
        int64_t ng = (G + 2) / 3, nd = D / 16;
        #pragma omp parallel for schedule(static) collapse(3) num_threads(threads) if (R * KV * G * S * D >= PAR_MIN)
        for (int64_t rh = 0; rh < R * KV; rh++)
            for (int64_t qg = 0; qg < ng; qg++)
                for (int64_t db = 0; db < nd; db++) {
                    int64_t r = rh / KV, h = rh % KV, i0 = 3 * qg, n = G - i0 < 3 ? G - i0 : 3;
                    pv_by16(p + (rh * G + i0) * S, n, S, D, 16 * db, v + r * vrs + h * vhs, vs + r * srs + h * shs,
                            out + (rh * G + i0) * D);
                }
        return;
    }
#endif
    int64_t nq = (G + QCHUNK - 1) / QCHUNK;
    #pragma omp parallel for schedule(static) collapse(2) num_threads(threads) if (R * KV * G * S * D >= PAR_MIN)
    for (int64_t rh = 0; rh < R * KV; rh++) {
        for (int64_t qc = 0; qc < nq; qc++) {
            int64_t r = rh / KV, h = rh % KV;
            const int16_t *vh = v + r * vrs + h * vhs;
            const int8_t *sh = vs + r * srs + h * shs;
            int64_t i0 = qc * QCHUNK, i1 = i0 + QCHUNK < G ? i0 + QCHUNK : G, n = i1 - i0;
            const double *ph = p + rh * G * S;
#if defined(__AVX2__)
            if (D % 8 == 0) {
                pv_by8(ph + i0 * S, n, S, D, vh, sh, out + (rh * G + i0) * D);
                continue;
            }
#endif
            double acc[QCHUNK][D_MAX];
            double vd[D_MAX];
            memset(acc, 0, sizeof acc);
            for (int64_t j = 0; j < S; j++) {
                const int16_t *vj = vh + j * D;
                double scale = pow2(sh[j]);
                for (int64_t d = 0; d < D; d++) vd[d] = (double)vj[d] * scale;
                for (int64_t i = 0; i < n; i++) {
                    double pij = ph[(i0 + i) * S + j];
                    if (pij == 0.0) continue;  /* a masked or negligible key: adds exactly nothing */
                    for (int64_t d = 0; d < D; d++) acc[i][d] += pij * vd[d];
                }
            }
            for (int64_t i = 0; i < n; i++) memcpy(out + (rh * G + i0 + i) * D, acc[i], D * sizeof(double));
        }
    }
}

/* Store new K or V rows x [R, KV, q, D] (float64 grid integers; strided, last dim contiguous) compactly at slots
 * starts[r] .. starts[r] + q - 1 of cache rows r: per key and head, shift = the exponent of
 * frexp(max |x|) less 15 (at least 0), m = rint(x * 2^-shift) clamped to +-32767. The same
 * numbers as `attn16.py`'s `compress`. */
void attn16_store(const double *x, int64_t xrs, int64_t xhs, int64_t xts, int64_t R, int64_t KV, int64_t q,
                  int64_t D, const int64_t *starts, int16_t *m, int64_t mrs, int64_t mhs, int8_t *sh, int64_t srs,
                  int64_t shs) {
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < KV; h++) {
            for (int64_t t = 0; t < q; t++) {
                const double *xt = x + r * xrs + h * xhs + t * xts;
                double top = 0.0;
                #pragma omp simd reduction(max:top)
                for (int64_t d = 0; d < D; d++) { double a = fabs(xt[d]); top = a > top ? a : top; }
                int e = 0;
                frexp(top, &e);
                int s = e - 15 > 0 ? e - 15 : 0;
                double f = pow2(-s);
                int64_t slot = starts[r] + t;
                int16_t *mt = m + r * mrs + h * mhs + slot * D;
                for (int64_t d = 0; d < D; d++) {
                    double v = nearbyint(xt[d] * f);
                    v = v > 32767.0 ? 32767.0 : (v < -32767.0 ? -32767.0 : v);
                    mt[d] = (int16_t)v;
                }
                sh[r * srs + h * shs + slot] = (int8_t)s;
            }
        }
    }
}

/* m [R, KV, S, D] int16 (strided rows and heads) and shifts -> out [R, KV, S, D] float64, contiguous:
 * m * 2^shift, for a wide round's matmuls (many queries read each key: a float64 GEMM pays). */
void attn16_decompress(const int16_t *m, int64_t R, int64_t KV, int64_t S, int64_t D, int64_t mrs, int64_t mhs,
                       const int8_t *sh, int64_t srs, int64_t shs, double *out, int threads) {
    #pragma omp parallel for schedule(static) collapse(2) num_threads(threads) if (R * KV * S * D >= PAR_MIN)
    for (int64_t rh = 0; rh < R * KV; rh++) {
        for (int64_t j = 0; j < S; j++) {
            int64_t r = rh / KV, h = rh % KV;
            const int16_t *mj = m + r * mrs + h * mhs + j * D;
            double f = pow2(sh[r * srs + h * shs + j]), *o = out + (rh * S + j) * D;
            for (int64_t d = 0; d < D; d++) o[d] = (double)mj[d] * f;
        }
    }
}


/* P = rint(e^x) for x <= 20 ln 2, 0 where x < -1 (e^-1 < 0.5; also -inf, a masked key), as
 * `attn16.exp_round`: k = rint(x / ln 2), r = (x - k ln2_hi) - k ln2_lo, e^r by Horner's rule
 * (degree 13, |r| <= 0.35), times 2^k (exact, built from its bits), then rint. Branch-free, so
 * that the loops over keys vectorize. */
#define LN2_HI 6.93147180369123816490e-01
#define LN2_LO 1.90821492927058770002e-10
#define INV_LN2 1.44269504088896338700e+00
#define C2 (1.0 / 2)
#define C3 (1.0 / 6)
#define C4 (1.0 / 24)
#define C5 (1.0 / 120)
#define C6 (1.0 / 720)
#define C7 (1.0 / 5040)
#define C8 (1.0 / 40320)
#define C9 (1.0 / 362880)
#define C10 (1.0 / 3628800)
#define C11 (1.0 / 39916800)
#define C12 (1.0 / 479001600)
#define C13 (1.0 / 6227020800.0)
static inline double exp_round1(double x) {
    double xc = x >= -1.0 ? x : -1.0;
    double k = nearbyint(xc * INV_LN2);
    double r = (xc - k * LN2_HI) - k * LN2_LO;
    double p = C13;
    p = p * r + C12; p = p * r + C11; p = p * r + C10; p = p * r + C9; p = p * r + C8; p = p * r + C7;
    p = p * r + C6; p = p * r + C5; p = p * r + C4; p = p * r + C3; p = p * r + C2; p = p * r + 1.0;
    p = p * r + 1.0;
    /* 2^k from its bits; k (an integer, |k| < 2^51) read off the low bits of k + 1.5 * 2^52, not
     * converted: AVX2 has no vector double -> int64 conversion, and this loop must vectorize */
    double kk = k + 6755399441055744.0, two_k;
    int64_t ki;
    memcpy(&ki, &kk, 8);
    ki = (ki - 0x4338000000000000LL + 1023) << 52;
    memcpy(&two_k, &ki, 8);
    double e = nearbyint(p * two_k);
    return x >= -1.0 ? e : 0.0;
}

void attn16_exp_round(double *x, int64_t n) {  /* in place */
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = exp_round1(x[i]);
}

/* s [R, KV, G, S] contiguous scores (G = heads per key head x w; query i is token i % w) ->
 * in place, P = rint(e^(s' - (max s' - shift))) with s' = (s + mask[r * mrs + t * mts + j]) * scale
 * (no mask: NULL), and den [R, KV, G] = sum P * vscale: `engine.attention.exact_attention`'s
 * numbers, step for step. */
static int weights_impl(double *s, int64_t R, int64_t KV, int64_t G, int64_t S, int64_t w, const double *mask,
                        int64_t mrs, int64_t mts, double scale, double shift, double vscale, double *den, int threads,
                        int32_t *wh, int32_t *wl, int64_t ws) {
    int bad = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(|:bad) if (R * KV * G * S * 16 >= PAR_MIN)
    for (int64_t row = 0; row < R * KV * G; row++) {
        int64_t r = row / (KV * G), t = (row % G) % w;
        double *sr = s + row * S;
        const double *mt = mask ? mask + r * mrs + t * mts : NULL;
        double top = -INFINITY;
        if (mt) {
            for (int64_t j = 0; j < S; j++) sr[j] = sr[j] + mt[j];
        }
        #pragma omp simd reduction(max:top)
        for (int64_t j = 0; j < S; j++) {
            sr[j] = sr[j] * scale;
            top = sr[j] > top ? sr[j] : top;  /* a maximum: the same in any order */
        }
        double c = top - shift, sum = 0.0;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < S; j++) {
            double p = exp_round1(sr[j] - c);
            sr[j] = p;
            sum += p;  /* integers below 2^53: exact in any order */
        }
        den[row] = sum * vscale;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
        if (wh) bad |= row_words(sr, S, wh + row * ws, wl + row * ws);  /* while the row is in cache */
#endif
    }
    return bad;
}

void attn16_weights(double *s, int64_t R, int64_t KV, int64_t G, int64_t S, int64_t w, const double *mask,
                    int64_t mrs, int64_t mts, double scale, double shift, double vscale, double *den, int threads) {
    weights_impl(s, R, KV, G, S, w, mask, mrs, mts, scale, shift, vscale, den, threads, NULL, NULL, 0);
}

/* pv [R, KV, J * w, D], den [R, KV, J * w] float64 (head kv * J + j, query t at row j * w + t)
 * -> out [R, w, KV * J * D] bf16 = (float)(pv / den) rounded to nearest even (the heads side by
 * side, what o_proj reads; torch's .to(bfloat16) of a float64 goes through fp32 the same way) */
void attn16_out(const double *pv, const double *den, int64_t R, int64_t KV, int64_t J, int64_t w, int64_t D,
                uint16_t *out) {
    int64_t H = KV * J;
    for (int64_t r = 0; r < R; r++)
        for (int64_t kv = 0; kv < KV; kv++)
            for (int64_t g = 0; g < J * w; g++) {
                int64_t j = g / w, t = g % w, row = (r * KV + kv) * J * w + g;
                const double *src = pv + row * D;
                uint16_t *dst = out + ((r * w + t) * H + kv * J + j) * D;
                for (int64_t d = 0; d < D; d++) dst[d] = float_to_bf16((float)(src[d] / den[row]));
            }
}


/* One layer's exact attention for a narrow round, in one call: x [R, w, nq + 2 KV, D] float64
 * (the layer's q, k and v heads on their grids, `kernels.layer.rope`); the new K and V stored at
 * slots starts[r] .. of cache rows r (attn16_store), then each query row rounded (q_round) and its
 * scores against slots 0 .. S - 1 as integer dot products (scores_i16: attn16_scores' bits over
 * the rounded rows), the softmax weights (attn16_weights), the weighted values (attn16_pv) and the
 * output in bf16 (attn16_out): the steps of `engine.attention.exact_attention`, in the same order,
 * so the same bits. Scratch is this thread's, reused (a fresh allocation of a long context's
 * scores would page-fault every layer). Returns nonzero when scratch cannot be had. */
static __thread double *direct_buf = NULL;
static __thread size_t direct_cap = 0;

int attn16_direct(const double *x, int64_t R, int64_t w, int64_t nq, int64_t KV, int64_t D, const int64_t *starts,
                  int64_t S, int16_t *kc, int16_t *vc, int64_t crs, int64_t chs, int8_t *ks, int8_t *vs,
                  int64_t srs, int64_t shs, const double *mask, int64_t mrs, int64_t mts, double scale,
                  double shift, double vscale, uint16_t *out, int threads) {
    int64_t heads = nq + 2 * KV, J = nq / KV, G = J * w, n = R * KV * G;
    size_t need = (size_t)n * (size_t)(S + D + 1) + ((size_t)n * (size_t)(2 * D + 1) + 7) / 8;
    if (need > direct_cap) {
        double *buf = (double *)realloc(direct_buf, need * sizeof(double));
        if (!buf) return 1;
        direct_buf = buf;
        direct_cap = need;
    }
    double *sc = direct_buf, *pv = sc + n * S, *den = pv + n * D;
    int16_t *qi = (int16_t *)(den + n);
    int8_t *qs = (int8_t *)(qi + n * D);
    int64_t xrs = w * heads * D, xts = heads * D;
    int qb = q_bits(D);
    attn16_store(x + nq * D, xrs, D, xts, R, KV, w, D, starts, kc, crs, chs, ks, srs, shs);
    attn16_store(x + (nq + KV) * D, xrs, D, xts, R, KV, w, D, starts, vc, crs, chs, vs, srs, shs);
    for (int64_t r = 0; r < R; r++)  /* q [R, nq, w, D] -> [R, KV, J w, D]: head kv J + j, query t at row j w + t */
        for (int64_t kv = 0; kv < KV; kv++)
            for (int64_t g = 0; g < G; g++) {
                int64_t row = (r * KV + kv) * G + g;
                qs[row] = (int8_t)q_round(x + r * xrs + (g % w) * xts + (kv * J + g / w) * D, D, qb, qi + row * D);
            }
    scores_i16(qi, qs, R, KV, G, D, kc, crs, chs, ks, srs, shs, S, sc, threads, PAR_MIN);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    int64_t ws = (S + 1) / 2 + 16;  /* the integer weighted sums' words, written as the weights are made */
    int32_t *wh = int_pv_on && D % 32 == 0 && pv_uniform(vs, R, KV, S, srs, shs) ? words_scratch((size_t)(2 * n * ws)) : NULL;
    if (wh && !weights_impl(sc, R, KV, G, S, w, mask, mrs, mts, scale, shift, vscale, den, threads, wh, wh + n * ws, ws)) {
        pv_words(wh, wh + n * ws, ws, R, KV, G, D, vc, crs, chs, vs, srs, shs, S, pv, threads);
        attn16_out(pv, den, R, KV, J, w, D, out);
        return 0;
    }
    if (!wh)  /* else sc holds the weights already, one past 2^20: the float64 tiles */
#endif
    attn16_weights(sc, R, KV, G, S, w, mask, mrs, mts, scale, shift, vscale, den, threads);
    attn16_pv(sc, R, KV, G, D, vc, crs, chs, vs, srs, shs, S, pv, threads);
    attn16_out(pv, den, R, KV, J, w, D, out);
    return 0;
}
