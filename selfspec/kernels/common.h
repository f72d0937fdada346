/* What every kernel uses: the C headers, bf16 <-> fp32 as torch converts them, exact powers of
 * two, and the broadcast dot-product instructions gcc does not emit by itself. Each kernel's .c
 * file includes it first; the build key and `build.sources_key` read every header. */
#ifndef SELFSPEC_COMMON_H
#define SELFSPEC_COMMON_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, as torch's .to(bfloat16); a NaN stays a (quiet) NaN. A select, not a
 * branch, so that loops calling it vectorize. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16, nan = (u >> 16) | 0x40;
    return (uint16_t)((u & 0x7fffffff) > 0x7f800000 ? nan : rounded);
}

static inline double pow2(int e) {  /* 2^e for a normal e (|e| < 1023), exactly ldexp(1.0, e), without the call */
    union { double d; int64_t i; } t;
    t.i = ((int64_t)e + 1023) << 52;
    return t.d;
}

/* keeps v in a register: with 3 or more rows gcc otherwise reassociates a block's integer sums
 * into a tree of every product and spills them to the stack; with 1 or 2 the free schedule is
 * faster */
#define PIN(v) __asm__("" : "+x"(v))

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* float_to_bf16 sixteen lanes at a time (the compiler's own vectorized select runs 8 wide) */
static inline __m256i ps_to_bf16_z(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __mmask16 isnan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                              _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, isnan, nan));
}

static inline __m512 bf16_to_ps_z(const uint16_t *h) {  /* bf16_to_float of h[0 .. 15] */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* acc += the dot products of each 32-bit lane of v with 4 bytes (vpdpbusd: unsigned v, signed m)
 * or 2 int16 (vpdpwssd) broadcast from memory: gcc does not fold the broadcast into the
 * instruction by itself, and a separate broadcast costs a third of a loop */
#define DPBUSD_BCAST(acc, v, m) __asm__("vpdpbusd %[xm]%{1to16%}, %[wv], %[av]" : [av] "+v"(acc) : [wv] "v"(v), [xm] "m"(m))
#define DPWSSD_BCAST(acc, v, m) __asm__("vpdpwssd %[xm]%{1to16%}, %[xv], %[av]" : [av] "+v"(acc) : [xv] "v"(v), [xm] "m"(m))
#endif
#endif
