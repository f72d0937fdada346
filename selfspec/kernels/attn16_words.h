/* The exact attention's weighted sums in integers (included by attn16.c after attn16_int.h; the
 * build key reads this header too). */
#ifndef SELFSPEC_ATTN16_WORDS_H
#define SELFSPEC_ATTN16_WORDS_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attn16_int.h"

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
#endif
