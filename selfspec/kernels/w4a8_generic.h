/* w4a8's loops in plain C, for the functions no instruction set's file gives this build
 * (w4a8_loops.h): the numbers every vector loop reproduces, bit for bit. */
#ifndef SELFSPEC_W4A8_GENERIC_H
#define SELFSPEC_W4A8_GENERIC_H
#include "w4a8.h"

#ifndef W4A8_Q512
/* row r of w4a8_quantize (w4a8.c) */
static inline void quantize_row(const void *x, int x_bf16, int64_t r, int64_t K, int8_t *xq, float *d, float *c,
                                int32_t *sx) {
    int64_t nb = K / BLOCK;
    float xb[BLOCK];
    for (int64_t b = 0; b < nb; b++) {
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + r * K + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) xb[i] = bf16_to_float(src[i]);
        } else {
            memcpy(xb, (const float *)x + r * K + b * BLOCK, sizeof xb);
        }
        int8_t *qb = xq + r * K + b * BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < BLOCK; i++) { float a = fabsf(xb[i]); amax = a > amax ? a : amax; }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < BLOCK; i++) { int v = (int)rintf(xb[i] * inv); qb[i] = (int8_t)v; sum += v; }
        d[r * nb + b] = amax / 127.0f;
        if (c) c[r * nb + b] = d[r * nb + b] * (float)sum;
        if (sx) sx[r * nb + b] = sum;
    }
}
#endif

#if !defined(W4A8_VNNI) && !defined(W4A8_AVX2)
/* acc_out [R][16] = R rows' sums over a tile's nb blocks (w4a8.h's sequence); tile_rows8: w8a8's,
 * before the outputs' scales */
static inline void tile_rows(const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const float *c,
                             int64_t K, int R, float *acc_out) {
    float acc[MAX_ROWS][TILE];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES) {
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + r * K + b * BLOCK;
            int32_t isum[TILE];
            for (int j = 0; j < TILE; j++) {
                int32_t s = 0;
                for (int ch = 0; ch < 4; ch++) {
                    const uint8_t *p = w + 64 * ch + 4 * j;
                    for (int i = 0; i < 4; i++)
                        s += (int32_t)(p[i] & 15) * xr[8 * ch + i] + (int32_t)(p[i] >> 4) * xr[8 * ch + 4 + i];
                }
                isum[j] = s;
            }
            const uint16_t *sh = (const uint16_t *)(w + 256), *mh = (const uint16_t *)(w + 288);
            float dr = d[r * nb + b], cr = c[r * nb + b];
            for (int j = 0; j < TILE; j++) {
                float t = ((float)isum[j] * half_to_float(sh[j])) * dr;
                float u = half_to_float(mh[j]) * cr;
                acc[r][j] = acc[r][j] + (t + u);
            }
        }
    }
    for (int r = 0; r < R; r++) memcpy(acc_out + 16 * r, acc[r], sizeof acc[r]);
}

static inline void tile_rows8(const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *sx,
                              int64_t K, int R, float *acc_out) {
    float acc[MAX_ROWS][TILE];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES8) {
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + r * K + b * BLOCK;
            for (int j = 0; j < TILE; j++) {
                int32_t s = 0;
                for (int ch = 0; ch < 8; ch++)
                    for (int i = 0; i < 4; i++) s += ((int32_t)w[64 * ch + 4 * j + i] - 128) * xr[4 * ch + i];
                acc[r][j] = acc[r][j] + (float)s * d[r * nb + b];
            }
        }
    }
    for (int r = 0; r < R; r++) memcpy(acc_out + 16 * r, acc[r], sizeof acc[r]);
}
#endif
#endif
