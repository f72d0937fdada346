/* The exact attention's two matmuls over the compact cache (int16 with a power-of-two shift per
 * key and head, or where kb == 1 the one-byte cache: int8 K times an int32 scale per key and head,
 * int8 V times a power of two, widened to int16 as they are read), read in place: no float64 copy
 * of the cache is made.
 *
 *   scores[r, h, i, j] = 2^ks[r, h, j] * sum_d q[r, h, i, d] * k[r, h, j, d]
 *   out[r, h, i, d]    = sum_j p[r, h, i, j] * 2^vs[r, h, j] * v[r, h, j, d]
 *
 * Every product and partial sum is an integer below 2^53 (the attention grid's bounds,
 * `engine/forward/attention.py`), so float64 arithmetic is exact in any order: the results are the
 * same bits as torch's float64 matmul over the decompressed cache (`selfspec/kernels/attn16.py`),
 * whatever the threads, the vector width or the order of the sums.
 *
 * attn16_weights turns a row's scores into its integer softmax weights in place (mask, scale,
 * max, exponential, rounding, their sum); its exponential is a fixed sequence of IEEE multiplies
 * and adds (built with -ffp-contract=off), which `attn16.py` repeats in torch ops, so the
 * fallback gives the same bits (libm's and torch's own exp need not agree in the last bit, and
 * torch's vector body and scalar tail need not either). */
#include "common.h"
#include "attn16.h"
#include "attn16_scores.h"
#include "attn16_avx2.h"
#include "attn16_avx512.h"
#include "attn16_words.h"
#include "attn16_store.h"
#include "attn16_split.h"

static int int_pv_on = 1;  /* attn16_set_int_pv */

/* Sets PAR_MIN, returns the previous value: for tests (every step's bits are the same on one
 * thread or shared out) and A/B timing in one process. */
int64_t attn16_set_par_min(int64_t v) {
    int64_t old = par_min;
    par_min = v;
    return old;
}


/* Whether attn16_pv may take the integer path (where it exists, 1 by default); returns the previous
 * setting. For tests and A/B timing in one process: both paths give the same bits. */
int attn16_set_int_pv(int on) {
    int old = int_pv_on;
    int_pv_on = on;
    return old;
}

/* 1 where attn16_pv's tiles beat torch's float64 GEMM at every width (AVX-512, on a prefill
 * chunk's shape), so that `attn16.weighted` runs them for wide rounds too; else 0 */
int attn16_pv_wide(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* q [R, KV, G, D] contiguous float64 grid integers; k rows at k + r*krs + h*khs + j*D (int16 with
 * int8 shifts, or where kb == 1 int8 with int32 scales: the one-byte cache), their factors at
 * ks + r*srs + h*shs + j; scores [R, KV, G, S] contiguous: each query row rounded (q_round) and its
 * scores summed as int16 products (scores_i16). Returns 1 when scratch cannot be had (nothing
 * written), else 0. */
int attn16_scores(const double *q, int64_t R, int64_t KV, int64_t G, int64_t D, const void *k,
                  int64_t krs, int64_t khs, const void *ks, int64_t srs, int64_t shs, int64_t S,
                  double *scores, int threads, int kb) {
    int64_t n = R * KV * G;
    int16_t *qi = malloc((size_t)(n * D) * sizeof(int16_t));
    int8_t *qs = malloc((size_t)n);
    if (!qi || !qs) {
        free(qi); free(qs);
        return 1;
    }
    int qb = q_bits(D);
    for (int64_t row = 0; row < n; row++) qs[row] = (int8_t)q_round(q + row * D, D, qb, qi + row * D);
    scores_i16(qi, qs, R, KV, G, D, k, krs, khs, ks, srs, shs, S, scores, threads, PAR_MIN, kb);
    free(qi); free(qs);
    return 0;
}

static int pv_any(const double *p, int64_t R, int64_t KV, int64_t G, int64_t D, const void *v, int64_t vrs,
                  int64_t vhs, const int8_t *vs, int64_t srs, int64_t shs, int64_t S, double *out, int threads, int kb);

/* p [R, KV, G, S] contiguous; v like k (int16, or int8 where kb == 1); out [R, KV, G, D]
 * contiguous. Returns 1 when a one-byte cache's widened copy cannot be had (nothing written). */
int attn16_pv(const double *p, int64_t R, int64_t KV, int64_t G, int64_t D, const void *v, int64_t vrs,
              int64_t vhs, const int8_t *vs, int64_t srs, int64_t shs, int64_t S, double *out, int threads, int kb) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (int_pv_on && D % 32 == 0 && S > 0 &&
        (kb == 1 ? pv_fits8(vs, R, KV, S, srs, shs) : pv_uniform(vs, R, KV, S, srs, shs))) {
        int64_t n = R * KV * G, ws = (S + 1) / 2 + 16;
        int32_t *wh = words_scratch((size_t)(2 * n * ws + 2 * pv_part(R, KV, G, D, S)));
        if (wh && weights_words(p, n, S, wh, wh + n * ws, ws, threads)) {
            pv_words(wh, wh + n * ws, ws, R, KV, G, D, v, vrs, vhs, vs, srs, shs, S, out, (double *)(wh + 2 * n * ws),
                     threads, kb);
            return 0;
        }
    }
#endif
    if (pv_any(p, R, KV, G, D, v, vrs, vhs, vs, srs, shs, S, out, threads, kb) == 0) return 0;
    /* a one-byte cache no loop here reads in place: its values widened once (shifts kept), then the same loops */
    int16_t *w16 = malloc((size_t)(R * KV * S * D) * sizeof(int16_t));
    if (!w16) return 1;
    for (int64_t rh = 0; rh < R * KV; rh++)
        widen8((const int8_t *)v + (rh / KV) * vrs + (rh % KV) * vhs, S, D, w16 + rh * S * D);
    pv_any(p, R, KV, G, D, w16, KV * S * D, S * D, vs, srs, shs, S, out, threads, 2);
    free(w16);
    return 0;
}

/* attn16_pv's float64 loops (shifts per key) over an int16 cache: AVX-512 tiles, AVX2, or plain C; over
 * a one-byte cache's V (kb == 1) the AVX2 loop where it is this CPU's, else nothing (returns 1) */
static int pv_any(const double *p, int64_t R, int64_t KV, int64_t G, int64_t D, const void *vc, int64_t vrs,
                  int64_t vhs, const int8_t *vs, int64_t srs, int64_t shs, int64_t S, double *out, int threads, int kb) {
    const int16_t *v = (const int16_t *)vc;
#if defined(__AVX512F__)
    if (kb == 1) return 1;
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
        return 0;
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
                    if (kb == 1)  /* widened as loaded */
                        pv_by16_8(p + (rh * G + i0) * S, n, S, D, 16 * db, (const int8_t *)vc + r * vrs + h * vhs,
                                  vs + r * srs + h * shs, out + (rh * G + i0) * D);
                    else
                        pv_by16(p + (rh * G + i0) * S, n, S, D, 16 * db, v + r * vrs + h * vhs, vs + r * srs + h * shs,
                                out + (rh * G + i0) * D);
                }
        return 0;
    }
#endif
    if (kb == 1) return 1;
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
    return 0;
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
                  int64_t S, void *kc, void *vc, int64_t crs, int64_t chs, void *ks, int8_t *vs,
                  int64_t srs, int64_t shs, const double *mask, int64_t mrs, int64_t mts, double scale,
                  double shift, double vscale, uint16_t *out, int threads, int kb) {
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
    if (kb == 1)  /* the one-byte cache's K: integer scales */
        attn16_store_k8(x + nq * D, xrs, D, xts, R, KV, w, D, starts, kc, crs, chs, ks, srs, shs);
    else
        attn16_store(x + nq * D, xrs, D, xts, R, KV, w, D, starts, kc, crs, chs, ks, srs, shs, kb);
    attn16_store(x + (nq + KV) * D, xrs, D, xts, R, KV, w, D, starts, vc, crs, chs, vs, srs, shs, kb);
    for (int64_t r = 0; r < R; r++)  /* q [R, nq, w, D] -> [R, KV, J w, D]: head kv J + j, query t at row j w + t */
        for (int64_t kv = 0; kv < KV; kv++)
            for (int64_t g = 0; g < G; g++) {
                int64_t row = (r * KV + kv) * G + g;
                qs[row] = (int8_t)q_round(x + r * xrs + (g % w) * xts + (kv * J + g / w) * D, D, qb, qi + row * D);
            }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    int words = int_pv_on && D % 32 == 0 &&  /* the integer weighted sums */
                (kb == 1 ? pv_fits8(vs, R, KV, S, srs, shs) : pv_uniform(vs, R, KV, S, srs, shs));
    if (threads > 1 && S >= SPLIT_MIN && G <= 3 && words) {
        int32_t *scr = words_scratch((size_t)split_scratch(n, S, D, threads));
        if (scr) {
            if (split_attention(qi, qs, R, KV, G, w, D, S, kc, vc, crs, chs, ks, vs, srs, shs, mask, mrs, mts, scale,
                                shift, vscale, sc, pv, den, scr, threads, kb)
                && attn16_pv(sc, R, KV, G, D, vc, crs, chs, vs, srs, shs, S, pv, threads, kb))
                return 1;
            attn16_out(pv, den, R, KV, J, w, D, out);
            return 0;
        }
    }
#endif
    scores_i16(qi, qs, R, KV, G, D, kc, crs, chs, ks, srs, shs, S, sc, threads, PAR_MIN, kb);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    int64_t ws = (S + 1) / 2 + 16;  /* the integer weighted sums' words, written as the weights are made */
    int32_t *wh = words ? words_scratch((size_t)(2 * n * ws + 2 * pv_part(R, KV, G, D, S))) : NULL;
    if (wh && !weights_impl(sc, R, KV, G, S, w, mask, mrs, mts, scale, shift, vscale, den, threads, wh, wh + n * ws, ws)) {
        pv_words(wh, wh + n * ws, ws, R, KV, G, D, vc, crs, chs, vs, srs, shs, S, pv, (double *)(wh + 2 * n * ws), threads,
                 kb);
        attn16_out(pv, den, R, KV, J, w, D, out);
        return 0;
    }
    if (!wh)  /* else sc holds the weights already, one past 2^20: the float64 tiles */
#endif
    attn16_weights(sc, R, KV, G, S, w, mask, mrs, mts, scale, shift, vscale, den, threads);
    if (attn16_pv(sc, R, KV, G, D, vc, crs, chs, vs, srs, shs, S, pv, threads, kb)) return 1;
    attn16_out(pv, den, R, KV, J, w, D, out);
    return 0;
}
