/* w4a8's loops with AVX-512 (w4a8_loops.h picks them): the activations' quantization 16 lanes
 * at a time (F and BW), and with VNNI the tiles' four-byte dot products, one instruction per 16
 * outputs and 4 inputs, the broadcast row bytes folded into it. */
#ifndef SELFSPEC_W4A8_AVX512_H
#define SELFSPEC_W4A8_AVX512_H
#include "w4a8.h"

#ifdef W4A8_Q512
/* row r of w4a8_quantize (w4a8.c) */
static inline void quantize_row(const void *x, int x_bf16, int64_t r, int64_t K, int8_t *xq, float *d, float *c,
                                int32_t *sx) {
    int64_t nb = K / BLOCK;
    /* w4a8_generic.h's loop 16 lanes at a time: max is exact in any order (a NaN is skipped either way:
     * max_ps keeps its second operand), and cvtps2dq rounds to nearest even as rintf does */
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    for (int64_t b = 0; b < nb; b++) {
        __m512 x0, x1;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + r * K + b * BLOCK;
            x0 = bf16_to_ps_z(src), x1 = bf16_to_ps_z(src + 16);
        } else {
            const float *src = (const float *)x + r * K + b * BLOCK;
            x0 = _mm512_loadu_ps(src), x1 = _mm512_loadu_ps(src + 16);
        }
        __m512 a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x0), absmask));
        __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x1), absmask));
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(a1, _mm512_max_ps(a0, _mm512_setzero_ps())));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
        int8_t *qb = xq + r * K + b * BLOCK;
        _mm_storeu_si128((__m128i *)qb, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtepi32_epi8(q1));
        int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        d[r * nb + b] = amax / 127.0f;
        if (c) c[r * nb + b] = d[r * nb + b] * (float)sum;
        if (sx) sx[r * nb + b] = sum;
    }
}
#endif

#ifdef W4A8_VNNI
static inline __attribute__((always_inline)) void tile_rows(
        const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const float *c, int64_t K, int R,
        float *acc_out /* [R][16] */) {
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES) {
        for (int l = 0; l < TILE_BYTES; l += 64) _mm_prefetch((const char *)(w + PREFETCH_Z + l), _MM_HINT_T0);
        __m512i ilo[MAX_ROWS], ihi[MAX_ROWS];  /* two chains per row: half the dependent latency */
        for (int r = 0; r < R; r++) { ilo[r] = _mm512_setzero_si512(); ihi[r] = _mm512_setzero_si512(); }
        for (int ch = 0; ch < 4; ch++) {
            __m512i raw = _mm512_loadu_si512((const void *)(w + 64 * ch));
            __m512i lo = _mm512_and_si512(raw, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            for (int r = 0; r < R; r++) {
                const unaligned_i32 *xr = (const unaligned_i32 *)(xq + r * K + b * BLOCK + 8 * ch);
                DPBUSD_BCAST(ilo[r], lo, xr[0]);
                DPBUSD_BCAST(ihi[r], hi, xr[1]);
            }
        }
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 256)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 288)));
        for (int r = 0; r < R; r++) {
            __m512i isum = _mm512_add_epi32(ilo[r], ihi[r]);
            __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), s), _mm512_set1_ps(d[r * nb + b]));
            __m512 u = _mm512_mul_ps(m, _mm512_set1_ps(c[r * nb + b]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(t, u));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc_out + 16 * r, acc[r]);
}

static inline __attribute__((always_inline)) void tile_rows8(
        const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *sx, int64_t K, int R,
        float *acc_out) {
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES8) {
        for (int l = 0; l < TILE_BYTES8; l += 64) _mm_prefetch((const char *)(w + PREFETCH8_Z + l), _MM_HINT_T0);
        __m512i i0[MAX_ROWS], i1[MAX_ROWS];
        for (int r = 0; r < R; r++) { i0[r] = _mm512_setzero_si512(); i1[r] = _mm512_setzero_si512(); }
        for (int ch = 0; ch < 8; ch += 2) {
            __m512i w0 = _mm512_loadu_si512((const void *)(w + 64 * ch));
            __m512i w1 = _mm512_loadu_si512((const void *)(w + 64 * ch + 64));
            for (int r = 0; r < R; r++) {
                const unaligned_i32 *xr = (const unaligned_i32 *)(xq + r * K + b * BLOCK + 4 * ch);
                DPBUSD_BCAST(i0[r], w0, xr[0]);
                DPBUSD_BCAST(i1[r], w1, xr[1]);
            }
        }
        for (int r = 0; r < R; r++) {
            __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(i0[r], i1[r]), _mm512_set1_epi32(128 * sx[r * nb + b]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d[r * nb + b])));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc_out + 16 * r, acc[r]);
}

/* tile_rows8 for one block whose inputs 16 .. 31 are zeros (a rank-16 module's u): their chunks
 * (and their bytes of the tile) skipped, the same integer sums and float steps */
static inline __attribute__((always_inline)) void tile_rows8_half(
        const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *sx, int64_t K, int R,
        float *acc_out) {
    (void)nb;
    __m512i i0[MAX_ROWS], i1[MAX_ROWS];
    for (int r = 0; r < R; r++) { i0[r] = _mm512_setzero_si512(); i1[r] = _mm512_setzero_si512(); }
    for (int ch = 0; ch < 4; ch += 2) {
        __m512i w0 = _mm512_loadu_si512((const void *)(w + 64 * ch));
        __m512i w1 = _mm512_loadu_si512((const void *)(w + 64 * ch + 64));
        for (int r = 0; r < R; r++) {
            const unaligned_i32 *xr = (const unaligned_i32 *)(xq + r * K + 4 * ch);
            DPBUSD_BCAST(i0[r], w0, xr[0]);
            DPBUSD_BCAST(i1[r], w1, xr[1]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(i0[r], i1[r]), _mm512_set1_epi32(128 * sx[r]));
        __m512 acc = _mm512_add_ps(_mm512_setzero_ps(), _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d[r])));
        _mm512_storeu_ps(acc_out + 16 * r, acc);
    }
}
#endif
#endif
