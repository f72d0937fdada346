/* silu.h's steps 8 lanes at a time with AVX2 (layer.c's layer_silu_mul runs a row's whole groups
 * of 8 through them, the rest through silu_mul1). */
#ifndef SELFSPEC_SILU_AVX2_H
#define SELFSPEC_SILU_AVX2_H
#include "silu.h"

#if defined(__AVX2__)
/* the same steps 8 lanes at a time (min / max with the constant first: a NaN passes through, as
 * the scalar selects let it) */
static inline __m256 bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256i ps_to_bf16_bits(__m256 f) {  /* float_to_bf16 per lane, in the low 16 bits */
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, nan, isnan);
}

static inline __m256 exp_silu8(__m256 y) {
    y = _mm256_min_ps(_mm256_set1_ps(SILU_HI), y);
    y = _mm256_max_ps(_mm256_set1_ps(SILU_LO), y);
    __m256 k = _mm256_round_ps(_mm256_mul_ps(y, _mm256_set1_ps(INV_LN2F)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(y, _mm256_mul_ps(k, _mm256_set1_ps(LN2_HIF))),
                             _mm256_mul_ps(k, _mm256_set1_ps(LN2_LOF)));
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    const float c[7] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 7; i++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c[i]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif
#endif
