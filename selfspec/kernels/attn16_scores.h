/* The exact attention's scores: each key block through the widest loop this build has (one file
 * per instruction set), then one key at a time in plain C; and the scores of a whole round over
 * the threads. */
#ifndef SELFSPEC_ATTN16_SCORES_H
#define SELFSPEC_ATTN16_SCORES_H
#include "attn16.h"
#include "attn16_avx2.h"
#include "attn16_avx512.h"
#include "attn16_keytiles.h"

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
