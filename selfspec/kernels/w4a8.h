/* The w4a8 and w8a8 formats, shared by their loops (w4a8_<isa>.h), the draft LoRA (lora8.h) and
 * the matmuls (w4a8.c). Plain C, no torch headers: built by `build.py` with the machine's C
 * compiler and called through ctypes.
 *
 * Numerics (`w4a8.py` holds the same in torch, the fallback; tests compare the bits):
 *   activations, per row r and block b of 32 inputs:
 *     amax = max |x|, d = amax / 127, xq = rint(x * (127 / amax)) (0 when amax is 0)
 *     c = d * (float) sum(xq)
 *   weights, per output n and block b: w = q * s + m with q in 0..15
 *   y[r, n] = sum over b = 0, 1, ... in this order of
 *               ((float) isum * s) * d  +  m * c        isum = sum_i q_i * xq_i, an exact int32
 * Integer sums are exact in any order; the float steps are one fixed sequence per output element,
 * the same whatever the number of rows: a row's output is bitwise independent of the others.
 * Built with -ffp-contract=off so that no multiply and add fuse into an FMA the fallback lacks.
 *
 * Packed weight layout, per tile of 16 outputs and block of 32 inputs (320 bytes, contiguous over
 * the blocks of a tile): 256 bytes of nibbles, then 16 fp16 scales, then 16 fp16 minimums. In the
 * nibbles, 64-byte chunk c (0..3) holds inputs 8c..8c+7 of the block: byte 4j + i has input 8c + i
 * of output j in its low nibble and input 8c + 4 + i in its high nibble (what VNNI's 4-byte dot
 * product per 32-bit lane wants).
 *
 * w8a8 (an output head, where 4 bits cost too much quality): int8 weights with one fp32 scale per
 * output, the same activations; y[r, n] = s_n * (sum over b in order of (float) isum * d), isum
 * exact. Per tile and block 512 bytes: chunk c (0..7) holds inputs 4c..4c+3, byte 4j + i is
 * weight + 128 of output j, input 4c + i (unsigned, for VNNI; the 128 * sum(xq) is taken off). */
#ifndef SELFSPEC_W4A8_H
#define SELFSPEC_W4A8_H
#include "common.h"

#define TILE 16
#define BLOCK 32
#define TILE_BYTES 320
#define TILE_BYTES8 512  /* w8a8's */
/* which loops a build takes (w4a8_loops.h): the activations' quantization 16 lanes wide where
 * AVX-512 BW is at hand; the tiles' dot products with AVX-512 VNNI, AVX2, or plain C */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define W4A8_Q512 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W4A8_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__)
#define W4A8_AVX2 1
#endif
#ifdef W4A8_AVX2
#define MAX_ROWS 4  /* rows per pass over a tile: AVX2's 16 registers hold 4 rows' sums (the tile stays in L1) */
#else
#define MAX_ROWS 8
#endif
/* bytes ahead of the block being multiplied that the loops ask the cache for: at one or two rows
 * a forward streams its weights from memory, faster than the hardware prefetcher alone; a
 * prefetch past the end never faults. AVX-512's loops finish a block sooner: 8 blocks ahead. */
#define PREFETCH (4 * TILE_BYTES)
#define PREFETCH8 (4 * TILE_BYTES8)
#define PREFETCH_Z (8 * TILE_BYTES)
#define PREFETCH8_Z (8 * TILE_BYTES8)
typedef int32_t unaligned_i32 __attribute__((aligned(1), may_alias));
/* FN(w, nb, xr, dr, ARG, K, R, acc) with R a constant (the accumulators stay in registers) */
#define ROWS_CASE(FN, ARG, n) case n: if (n <= MAX_ROWS) FN(w, nb, xr, dr, ARG, K, n, acc); break;
#define ROWS_SWITCH(R, FN, ARG) switch (R) { \
    ROWS_CASE(FN, ARG, 8) ROWS_CASE(FN, ARG, 7) ROWS_CASE(FN, ARG, 6) ROWS_CASE(FN, ARG, 5) \
    ROWS_CASE(FN, ARG, 4) ROWS_CASE(FN, ARG, 3) ROWS_CASE(FN, ARG, 2) \
    default: FN(w, nb, xr, dr, ARG, K, 1, acc); break; }

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif
