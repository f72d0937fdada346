/* Scores of many query rows against one key head, sixteen keys per vector, where the CPU has
 * AVX-512 BW and VNNI (attn16_scores.h takes it from KEYTILE_G rows a key head).
 *
 * scores_z64 sums a key's 64 products in the lanes of two vectors and then reduces them across
 * lanes: a quarter of a four-way reduction per score, shuffles that cost as much as the products
 * once a round has more than a few query rows per key head (a verification round over a long
 * context, a prefill's pieces). Here a block of 16 keys is transposed once (their 32 pairs of
 * dimensions: kt[p] holds pair p of the 16 keys, one per 32-bit lane), and each query row's 16
 * scores are then 32 instructions, its pair p broadcast against kt[p]: no reduction across lanes.
 * The integer sums are the same (exact in int32, any order), so the same bits.
 *
 * 16 x 16 transpose of 32-bit words, r[k] lane p -> r[p] lane k: unpacks within 128-bit lanes
 * (words, then pairs of words) leave, for keys 4i .. 4i + 3, pair 4L + m in lane L of t[4i + m];
 * a 4 x 4 transpose of 128-bit lanes across i then puts keys 4c .. 4c + 3 in lane c. */
#ifndef SELFSPEC_ATTN16_KEYTILES_H
#define SELFSPEC_ATTN16_KEYTILES_H
#include "attn16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

#define KEYTILE_G 6  /* query rows per key head from which scores_keytiles runs (fewer: scores_z64) */
typedef int32_t keytile_i32 __attribute__((aligned(2), may_alias));  /* a query row's pairs of int16 */

static inline __attribute__((always_inline)) void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    __m512i u[4][4];  /* u[i][m]: lane L holds pair 4L + m of keys 4i .. 4i + 3 */
    for (int i = 0; i < 4; i++) {
        u[i][0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[i][1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[i][2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[i][3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        __m512i x0 = _mm512_shuffle_i32x4(u[0][m], u[1][m], 0x44), x1 = _mm512_shuffle_i32x4(u[0][m], u[1][m], 0xEE);
        __m512i y0 = _mm512_shuffle_i32x4(u[2][m], u[3][m], 0x44), y1 = _mm512_shuffle_i32x4(u[2][m], u[3][m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
}

/* sixteen keys' factors (2^shift, or a one-byte cache's integer scales) as two vectors of doubles */
static inline __attribute__((always_inline)) void key_x16(const void *sh, int64_t j, const int kb, __m512d f[2]) {
    for (int h = 0; h < 2; h++) {
        if (kb == 1) {
            f[h] = _mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i *)((const int32_t *)sh + j + 8 * h)));
        } else {
            int64_t e8;
            memcpy(&e8, (const int8_t *)sh + j + 8 * h, 8);
            f[h] = _mm512_castsi512_pd(_mm512_slli_epi64(
                _mm512_add_epi64(_mm512_cvtepi8_epi64(_mm_cvtsi64_si128(e8)), _mm512_set1_epi64(1023)), 52));
        }
    }
}

/* scores of keys j .. j1 - 1 (D == 64) for G query rows, sixteen keys at a time; returns the first
 * key it left (fewer than 16 remain) */
static inline __attribute__((always_inline)) int64_t scores_keytiles(const int16_t *qi, const int8_t *qs, int64_t G,
                                                                     const void *kh, const void *sh, int64_t j,
                                                                     int64_t j1, int64_t S, double *out, const int kb) {
    const int64_t D = 64;
    int32_t kt[32 * 16] __attribute__((aligned(64)));
    for (; j + 16 <= j1; j += 16) {
        for (int l = 0; l < 16 * D * kb; l += 64)  /* the next block's keys, while this one's rows are summed */
            _mm_prefetch((const char *)kh + (j + 16) * D * kb + l, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {  /* dimensions 32 h .. 32 h + 31: pairs 16 h .. 16 h + 15 */
            __m512i r[16];
            for (int v = 0; v < 16; v++)  /* a one-byte cache's keys widened as they are loaded */
                r[v] = kb == 1 ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                     (const __m256i *)((const int8_t *)kh + (j + v) * D + 32 * h)))
                               : _mm512_loadu_si512((const void *)((const int16_t *)kh + (j + v) * D + 32 * h));
            transpose16x16(r);
            for (int p = 0; p < 16; p++) _mm512_store_si512((void *)(kt + (16 * h + p) * 16), r[p]);
        }
        __m512d f[2];
        key_x16(sh, j, kb, f);
        for (int64_t i0 = 0; i0 < G; i0 += 3) {  /* three rows at a time: six independent sums */
            const keytile_i32 *qp[3];
            for (int u = 0; u < 3; u++) qp[u] = (const keytile_i32 *)(qi + (i0 + u < G ? i0 + u : i0) * D);
            __m512i a[3][2];
            for (int u = 0; u < 3; u++) a[u][0] = a[u][1] = _mm512_setzero_si512();
            for (int p = 0; p < 32; p += 2) {
                __m512i k0 = _mm512_load_si512((const void *)(kt + p * 16)), k1 = _mm512_load_si512((const void *)(kt + (p + 1) * 16));
                for (int u = 0; u < 3; u++) {
                    a[u][0] = _mm512_dpwssd_epi32(a[u][0], _mm512_set1_epi32(qp[u][p]), k0);
                    a[u][1] = _mm512_dpwssd_epi32(a[u][1], _mm512_set1_epi32(qp[u][p + 1]), k1);
                }
            }
            for (int u = 0; u < 3 && i0 + u < G; u++) {
                __m512i s = _mm512_add_epi32(a[u][0], a[u][1]);
                __m512d q2 = _mm512_set1_pd(pow2(qs[i0 + u]));
                double *o = out + (i0 + u) * S + j;
                _mm512_storeu_pd(o, _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(s)), f[0]), q2));
                _mm512_storeu_pd(o + 8, _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(s, 1)), f[1]), q2));
            }
        }
    }
    return j;
}
#endif
#endif
