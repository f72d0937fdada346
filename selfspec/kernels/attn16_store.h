/* The compact cache's writes and its widened copy (plain C, every CPU): new K / V rows rounded into the cache (int16 or int8 with a shift, or the one-byte
 * cache's K with an integer scale) and a cache's values as float64 for a wide round's GEMM. */
#ifndef SELFSPEC_ATTN16_STORE_H
#define SELFSPEC_ATTN16_STORE_H
#include "attn16.h"

/* Store new K or V rows x [R, KV, q, D] (float64 grid integers; strided, last dim contiguous) compactly at slots
 * starts[r] .. starts[r] + q - 1 of cache rows r: per key and head, shift = the exponent of
 * frexp(max |x|) less 15 (at least 0), m = rint(x * 2^-shift) clamped to +-32767, as int16; with
 * kb == 1 (the one-byte cache's V) less 7, clamped to +-127, as int8. The same numbers as
 * `attn16.py`'s `compress`. */
void attn16_store(const double *x, int64_t xrs, int64_t xhs, int64_t xts, int64_t R, int64_t KV, int64_t q,
                  int64_t D, const int64_t *starts, void *m, int64_t mrs, int64_t mhs, int8_t *sh, int64_t srs,
                  int64_t shs, int kb) {
    const int bits = kb == 1 ? 7 : 15;
    const double top_m = kb == 1 ? 127.0 : 32767.0;
    for (int64_t r = 0; r < R; r++) {
        for (int64_t h = 0; h < KV; h++) {
            for (int64_t t = 0; t < q; t++) {
                const double *xt = x + r * xrs + h * xhs + t * xts;
                double top = 0.0;
                #pragma omp simd reduction(max:top)
                for (int64_t d = 0; d < D; d++) { double a = fabs(xt[d]); top = a > top ? a : top; }
                int e = 0;
                frexp(top, &e);
                int s = e - bits > 0 ? e - bits : 0;
                double f = pow2(-s);
                int64_t slot = starts[r] + t, at = r * mrs + h * mhs + slot * D;
                for (int64_t d = 0; d < D; d++) {
                    double v = nearbyint(xt[d] * f);
                    v = v > top_m ? top_m : (v < -top_m ? -top_m : v);
                    if (kb == 1) ((int8_t *)m)[at + d] = (int8_t)v;
                    else ((int16_t *)m)[at + d] = (int16_t)v;
                }
                sh[r * srs + h * shs + slot] = (int8_t)s;
            }
        }
    }
}

/* A one-byte cache's new K rows x [R, KV, q, D] (as attn16_store takes them) at slots starts[r] ..: per
 * key and head the integer scale c = max(1, ceil(max |x| / 127)) (int32) and m = rint(x / c) clamped
 * to +-127 (int8): k ~= m c, within c / 2. The same numbers as `attn16.py`'s `compress_scaled`. */
void attn16_store_k8(const double *x, int64_t xrs, int64_t xhs, int64_t xts, int64_t R, int64_t KV, int64_t q,
                     int64_t D, const int64_t *starts, int8_t *m, int64_t mrs, int64_t mhs, int32_t *c, int64_t srs,
                     int64_t shs) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < KV; h++)
            for (int64_t t = 0; t < q; t++) {
                const double *xt = x + r * xrs + h * xhs + t * xts;
                double top = 0.0;
                #pragma omp simd reduction(max:top)
                for (int64_t d = 0; d < D; d++) { double a = fabs(xt[d]); top = a > top ? a : top; }
                double f = ceil(top / 127.0);
                f = f > 1.0 ? f : 1.0;
                int64_t slot = starts[r] + t, at = r * mrs + h * mhs + slot * D;
                for (int64_t d = 0; d < D; d++) {
                    double v = nearbyint(xt[d] / f);
                    m[at + d] = (int8_t)(v > 127.0 ? 127.0 : (v < -127.0 ? -127.0 : v));
                }
                c[r * srs + h * shs + slot] = (int32_t)f;
            }
}

/* m [R, KV, S, D] int16 (int8 where kb == 1; strided rows and heads) and shifts -> out [R, KV, S, D]
 * float64, contiguous: m * 2^shift, for a wide round's matmuls (many queries read each key: a
 * float64 GEMM pays: a wide round's values; K's scores never widen it). */
void attn16_decompress(const void *m, int64_t R, int64_t KV, int64_t S, int64_t D, int64_t mrs, int64_t mhs,
                       const int8_t *sh, int64_t srs, int64_t shs, double *out, int threads, int kb) {
    #pragma omp parallel for schedule(static) collapse(2) num_threads(threads) if (R * KV * S * D >= PAR_MIN)
    for (int64_t rh = 0; rh < R * KV; rh++) {
        for (int64_t j = 0; j < S; j++) {
            int64_t r = rh / KV, h = rh % KV;
            int64_t at = r * mrs + h * mhs + j * D;
            double f = pow2(sh[r * srs + h * shs + j]), *o = out + (rh * S + j) * D;
            if (kb == 1)
                for (int64_t d = 0; d < D; d++) o[d] = (double)((const int8_t *)m)[at + d] * f;
            else
                for (int64_t d = 0; d < D; d++) o[d] = (double)((const int16_t *)m)[at + d] * f;
        }
    }
}
#endif
