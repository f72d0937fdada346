/* A narrow round's exact attention with its keys split over the threads, where the CPU has
 * AVX-512 BW and VNNI (attn16.c's attn16_direct takes it for a one-token round over many keys).
 *
 * A one-token round has nine query rows on the default model (three per key head): split by rows,
 * the softmax step leaves one of two threads idle for a ninth of it, and each of the three steps
 * (scores, weights, weighted sums) costs a team's wake-up and a barrier. Here each thread takes a
 * range of keys for every row, in one parallel region: its scores, then (after one barrier, for
 * the rows' maxima over all keys) its weights, their words and its partial weighted sums, then
 * (after a second) a share of the rows' totals. The maximum is exact in any order and every sum is
 * of integers below 2^53, so the result is attn16_direct's other path's, bit for bit. */
#ifndef SELFSPEC_ATTN16_SPLIT_H
#define SELFSPEC_ATTN16_SPLIT_H
#include "attn16_scores.h"
#include "attn16_words.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

/* keys from which a one-token round (G <= 3 query rows a key head) splits them over the threads;
 * wider rounds have rows enough to split by, and ran slower split) */
#define SPLIT_MIN 512
#define SPLIT_ALIGN 48   /* a thread's keys start at a multiple of 48: whole words stores (16) and zero tests (12) */

/* int32 words of scratch split_attention needs beside the scores */
static inline int64_t split_scratch(int64_t n, int64_t S, int64_t D, int threads) {
    return 2 * n * ((S + 1) / 2 + 16) + 2 * (int64_t)threads * n * (2 + 2 * D);
}

/* qi, qs: the rounded query rows [R, KV, G, D] (q_round); sc [n, S] scratch for the scores, then the
 * weights; pv [n, D] and den [n] as attn16_pv and attn16_weights leave them. Returns nonzero where a
 * weight was no integer in 0 .. 2^20 (sc then holds every weight and den their sums: the float64
 * tiles take over). */
static int split_attention(const int16_t *qi, const int8_t *qs, int64_t R, int64_t KV, int64_t G, int64_t w,
                           int64_t D, int64_t S, const void *kc, const void *vc, int64_t crs, int64_t chs,
                           const void *ks, const int8_t *vs, int64_t srs, int64_t shs, const double *mask,
                           int64_t mrs, int64_t mts, double scale, double shift, double vscale, double *sc,
                           double *pv, double *den, int32_t *scratch, int threads, int kb) {
    int64_t n = R * KV * G, ws = (S + 1) / 2 + 16, tq = pv_group(G);
    int32_t *wh = scratch, *wl = scratch + n * ws;
    double *maxes = (double *)(scratch + 2 * n * ws), *sums = maxes + threads * n, *parts = sums + threads * n;
    int bad = 0;
    #pragma omp parallel num_threads(threads) reduction(|:bad)
    {
        int T = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t span = ((S + T - 1) / T + SPLIT_ALIGN - 1) / SPLIT_ALIGN * SPLIT_ALIGN;
        int64_t j0 = t * span < S ? t * span : S, j1 = j0 + span < S ? j0 + span : S;
        double *tmax = maxes + t * n, *tsum = sums + t * n, *part = parts + t * n * 2 * D;
        for (int64_t rh = 0; rh < R * KV; rh++) {  /* scores of keys j0 .. j1 - 1 */
            int64_t r = rh / KV, h = rh % KV, off = r * crs + h * chs, soff = r * srs + h * shs;
            const int16_t *qh = qi + rh * G * D;
            const int8_t *qsh = qs + rh * G;
            double *out = sc + rh * G * S;
            if (kb == 1) scores_rows8(qh, qsh, G, D, (const int8_t *)kc + off, (const int32_t *)ks + soff, j0, j1, S, out);
            else scores_rows(qh, qsh, G, D, (const int16_t *)kc + off, (const int8_t *)ks + soff, j0, j1, S, out);
        }
        for (int64_t row = 0; row < n; row++) {  /* weights_impl's first steps, on these keys */
            double *sr = sc + row * S, top = -INFINITY;
            const double *mt = mask ? mask + (row / (KV * G)) * mrs + ((row % G) % w) * mts : NULL;
            if (mt)
                for (int64_t j = j0; j < j1; j++) sr[j] = sr[j] + mt[j];
            #pragma omp simd reduction(max:top)
            for (int64_t j = j0; j < j1; j++) {
                sr[j] = sr[j] * scale;
                top = sr[j] > top ? sr[j] : top;
            }
            tmax[row] = top;
        }
        #pragma omp barrier
        memset(part, 0, (size_t)(n * 2 * D) * sizeof(double));
        for (int64_t row = 0; row < n; row++) {  /* the weights, their words, their sum */
            double top = -INFINITY, sum = 0.0, *sr = sc + row * S;
            for (int u = 0; u < T; u++) top = maxes[u * n + row] > top ? maxes[u * n + row] : top;
            double c = top - shift;
            #pragma omp simd reduction(+:sum)
            for (int64_t j = j0; j < j1; j++) {
                double p = exp_round1(sr[j] - c);
                sr[j] = p;
                sum += p;
            }
            tsum[row] = sum;
            if (j1 > j0) bad |= row_words(sr + j0, j1 - j0, wh + row * ws + j0 / 2, wl + row * ws + j0 / 2);
        }
        if (!bad && j1 > j0)  /* the weighted sums of these keys' pairs (a last odd key pairs with a weight of 0) */
            for (int64_t rh = 0; rh < R * KV; rh++)
                for (int64_t i0 = 0; i0 < G; i0 += tq) {
                    int64_t r = rh / KV, h = rh % KV, nr = G - i0 < tq ? G - i0 : tq, row = rh * G + i0;
                    int64_t off = r * crs + h * chs;
                    if (kb == 1)
                        pv_chunks_of8(wh + row * ws, wl + row * ws, ws, nr, tq, S, D, j0 / 2, (j1 + 1) / 2,
                                      (const int8_t *)vc + off, vs + r * srs + h * shs, part + row * 2 * D);
                    else
                        pv_chunks_of(wh + row * ws, wl + row * ws, ws, nr, tq, S, D, j0 / 2, (j1 + 1) / 2,
                                     (const int16_t *)vc + off, part + row * 2 * D);
                }
        #pragma omp barrier
        for (int64_t row = t; row < n; row += T) {  /* the rows' totals */
            double sum = 0.0;
            for (int u = 0; u < T; u++) sum += sums[u * n + row];
            den[row] = sum * vscale;
            int64_t rh = row / G;
            pv_sum_parts(parts + row * 2 * D, T, n * 2 * D, D,
                         kb == 1 ? 1.0 : pow2(vs[(rh / KV) * srs + (rh % KV) * shs]), pv + row * D);
        }
    }
    return bad;
}
#endif
#endif
