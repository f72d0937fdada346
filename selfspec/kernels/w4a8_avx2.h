/* w4a8's loops with AVX2 (w4a8_loops.h picks them where AVX-512 VNNI is not at hand). */
#ifndef SELFSPEC_W4A8_AVX2_H
#define SELFSPEC_W4A8_AVX2_H
#include "w4a8.h"

#ifdef W4A8_AVX2
/* AVX2 has no 4-byte dot product: vpmaddubsw multiplies unsigned nibbles by signed bytes and adds
 * pairs into int16 (at most 2 * 15 * 127 = 3,810), eight of which sum in int16 without overflow
 * (30,480 < 32,767) before vpmaddwd adds the last pairs into int32: the same exact integer. */
static inline __attribute__((always_inline)) void tile_rows(
        const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const float *c, int64_t K, int R,
        float *acc_out /* [R][16] */) {
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES) {
        for (int l = 0; l < TILE_BYTES; l += 64) _mm_prefetch((const char *)(w + PREFETCH + l), _MM_HINT_T0);
        __m256i s16[MAX_ROWS][2];
        for (int r = 0; r < R; r++) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
        for (int ch = 0; ch < 4; ch++) {
            __m256i raw0 = _mm256_loadu_si256((const __m256i *)(w + 64 * ch));
            __m256i raw1 = _mm256_loadu_si256((const __m256i *)(w + 64 * ch + 32));
            __m256i lo0 = _mm256_and_si256(raw0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(raw0, 4), low);
            __m256i lo1 = _mm256_and_si256(raw1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(raw1, 4), low);
            for (int r = 0; r < R; r++) {
                const unaligned_i32 *xr = (const unaligned_i32 *)(xq + r * K + b * BLOCK + 8 * ch);
                __m256i xl = _mm256_set1_epi32(xr[0]), xh = _mm256_set1_epi32(xr[1]);
                s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                                         _mm256_maddubs_epi16(hi0, xh)));
                s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                                         _mm256_maddubs_epi16(hi1, xh)));
                if (R > 2) { PIN(s16[r][0]); PIN(s16[r][1]); }
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 256 + 16 * h)));
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 288 + 16 * h)));
            for (int r = 0; r < R; r++) {
                __m256i isum = _mm256_madd_epi16(s16[r][h], ones);
                __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), s), _mm256_set1_ps(d[r * nb + b]));
                __m256 u = _mm256_mul_ps(m, _mm256_set1_ps(c[r * nb + b]));
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_add_ps(t, u));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc_out + 16 * r, acc[r][0]);
        _mm256_storeu_ps(acc_out + 16 * r + 8, acc[r][1]);
    }
}

/* Signed weights (the stored byte xor 0x80 = weight) through vpmaddubsw as |w| times x with w's
 * sign (at most 2 * 128 * 127 = 32,512 per pair: no saturation), pairs into int32 by vpmaddwd:
 * sum w x, the integer the VNNI path gets as sum (w + 128) x - 128 sum x. */
static inline __attribute__((always_inline)) void tile_rows8(
        const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *sx, int64_t K, int R,
        float *acc_out) {
    (void)sx;
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES8) {
        for (int l = 0; l < TILE_BYTES8; l += 64) _mm_prefetch((const char *)(w + PREFETCH8 + l), _MM_HINT_T0);
        __m256i i32[MAX_ROWS][2];
        for (int r = 0; r < R; r++) i32[r][0] = i32[r][1] = _mm256_setzero_si256();
        for (int ch = 0; ch < 8; ch++) {
            __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * ch)), flip);
            __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * ch + 32)), flip);
            __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
            for (int r = 0; r < R; r++) {
                const unaligned_i32 *xr = (const unaligned_i32 *)(xq + r * K + b * BLOCK + 4 * ch);
                __m256i x = _mm256_set1_epi32(xr[0]);
                i32[r][0] = _mm256_add_epi32(i32[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones));
                i32[r][1] = _mm256_add_epi32(i32[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1)), ones));
                if (R > 2) { PIN(i32[r][0]); PIN(i32[r][1]); }
            }
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(_mm256_cvtepi32_ps(i32[r][h]), _mm256_set1_ps(d[r * nb + b])));
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc_out + 16 * r, acc[r][0]);
        _mm256_storeu_ps(acc_out + 16 * r + 8, acc[r][1]);
    }
}
#endif
#endif
