/* w4a8: 4-bit weights (groups of 32, an fp16 scale and minimum each, as GGUF's Q4_1) times
 * activations quantized per row and block of 32 to int8. Plain C, no torch headers: built by
 * `selfspec/kernels/build.py` with the machine's C compiler and called through ctypes.
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
 * w8a8 (an output head, where 4 bits cost too much quality; its loops are in w8a8.h, and both
 * formats' AMX tile path in w4a8_amx.h): int8 weights with one fp32 scale per
 * output, the same activations; y[r, n] = s_n * (sum over b in order of (float) isum * d), isum
 * exact. Per tile and block 512 bytes: chunk c (0..7) holds inputs 4c..4c+3, byte 4j + i is
 * weight + 128 of output j, input 4c + i (unsigned, for VNNI; the 128 * sum(xq) is taken off). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include "bf16.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 16
#define BLOCK 32
#define TILE_BYTES 320
#define TILE_BYTES8 512  /* w8a8's, below */
#if defined(__AVX2__) && defined(__F16C__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define MAX_ROWS 4  /* rows per pass over a tile: AVX2's 16 registers hold 4 rows' sums (the tile stays in L1) */
#else
#define MAX_ROWS 8
#endif
/* bytes ahead of the block being multiplied that the loops ask the cache for: at one or two rows
 * a forward streams its weights from memory, faster than the hardware prefetcher alone (f(1) of
 * the default model ~8% less on a 2-core EPYC with AVX2, 1-10% on a 2-core Xeon with AVX-512); a
 * prefetch past the end never faults */
#define PREFETCH (4 * TILE_BYTES)
#define PREFETCH8 (4 * TILE_BYTES8)
/* AVX-512's loops finish a block sooner: 8 blocks ahead against 4, the default model's layers on
 * the 2-core Xeon (`benchmarks/w4a8_ab.py --model`, five runs): 0.99-1.07x at 1 row, 1.02-1.06x at
 * 8 (16 blocks: 0.97x at 1-4 rows) */
#define PREFETCH_Z (8 * TILE_BYTES)
#define PREFETCH8_Z (8 * TILE_BYTES8)
/* keeps v in a register here: with 3 or more rows gcc otherwise reassociates a block's integer
 * sums into a tree of every product and spills them to the stack (1.3-1.5x slower at 4-64 rows);
 * with 1 or 2 the free schedule is faster */
#define PIN(v) __asm__("" : "+x"(v))
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

const char *w4a8_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return "avx512-vnni";
#elif defined(__AVX2__) && defined(__F16C__)
    return "avx2";
#else
    return "scalar";
#endif
}

/* row r of w4a8_quantize (below) */
static inline void quantize_row(const void *x, int x_bf16, int64_t r, int64_t K, int8_t *xq, float *d, float *c,
                                int32_t *sx) {
    int64_t nb = K / BLOCK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* the loop below 16 lanes at a time: max is exact in any order (a NaN is skipped either way:
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
    return;
#endif
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

/* x [M, K] fp32 or bf16 -> xq [M, K] int8, d [M, K/32], and where not NULL c [M, K/32] (w4a8's
 * d * sum(xq)) and sx [M, K/32] (w8a8's sum(xq)). Rows are independent: a prefill piece's rows are
 * shared out over the threads (serial, they were ~3% of a 3,000-token prefill with one core idle). */
void w4a8_quantize(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *xq, float *d, float *c, int32_t *sx,
                   int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (M >= 8)
    for (int64_t r = 0; r < M; r++) quantize_row(x, x_bf16, r, K, xq, d, c, sx);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* acc += w (unsigned bytes) . x (4 signed bytes broadcast from memory): gcc does not fold the
 * broadcast into the instruction by itself, and a separate broadcast costs a third of the loop */
#define DPBUSD_BCAST(acc, w, x) __asm__("vpdpbusd %[xm]%{1to16%}, %[wv], %[av]" : [av] "+v"(acc) : [wv] "v"(w), [xm] "m"(x))
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
#elif defined(__AVX2__) && defined(__F16C__)
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
#else
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
#endif

#include "w4a8_amx.h"

/* rows r0.. of a tile's outputs: acc [R][16] into y's columns t*16.. (bf16 when out_bf16) */
static inline void put_rows(const float *acc, int R, int64_t r0, int64_t t, int64_t N, void *y, int out_bf16) {
    int cols = (int)(N - t * TILE < TILE ? N - t * TILE : TILE);
    for (int r = 0; r < R; r++) {
        if (out_bf16) {
            uint16_t *yr = (uint16_t *)y + (r0 + r) * N + t * TILE;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            if (cols == TILE) {
                _mm256_storeu_si256((__m256i *)yr, ps_to_bf16_z(_mm512_loadu_ps(acc + r * TILE)));
                continue;
            }
#endif
            for (int j = 0; j < cols; j++) yr[j] = float_to_bf16(acc[r * TILE + j]);
        } else {
            memcpy((float *)y + (r0 + r) * N + t * TILE, acc + r * TILE, cols * sizeof(float));
        }
    }
}

/* the draft LoRA's steps inside the matmul's thread team (lora8.h) */
typedef struct lora_plan lora_plan_t;
static void lora_u_items(const lora_plan_t *p);
static void lora_tile(const lora_plan_t *p, int64_t t, uint16_t *out, int64_t N);
static void lora_rest(const lora_plan_t *p, uint16_t *out, int64_t N);

/* y [M, N] = the packed weight [N, K] times the quantized rows; bf16 out when out_bf16, else fp32.
 * The packed weight has ceil(N / 16) tiles; rows past N in the last one are padding, not written.
 * From AMX_MIN4 rows on a CPU with AMX, 16 rows at a time go through tiles (`w4a8_amx.h`, the
 * same bits). With a LoRA plan (y bf16), its u first, then each tile's delta after the tile. */
static void mm_impl(const int8_t *xq, const float *d, const float *c, int64_t M, int64_t K, const uint8_t *packed,
                    int64_t N, void *y, int out_bf16, int threads, const lora_plan_t *lp) {
    int64_t nb = K / BLOCK, tiles = (N + TILE - 1) / TILE;  /* the last tile may be zero-padded */
#ifdef W4A8_AMX
    if (amx_use(M, AMX_MIN4, INT64_MAX)) {
        #pragma omp parallel num_threads(threads)
        {
            int shape = 0;
            uint8_t *ub = amx_unpacked(nb);
            if (lp) lora_u_items(lp);
            #pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; t++) {
                const uint8_t *w = packed + t * nb * TILE_BYTES;
                float acc[AMX_ROWS * TILE];
                if (ub) amx_unpack4(w, nb, ub);
                for (int64_t r0 = 0; r0 < M; r0 += AMX_ROWS) {
                    int R = (int)(M - r0 < AMX_ROWS ? M - r0 : AMX_ROWS);
                    if (R >= AMX_GROUP_MIN && ub) {
                        const int8_t *xr = xq + r0 * K;
                        const float *dr = d + r0 * nb, *cr = c + r0 * nb;
                        if (R != shape) { amx_configure(R); shape = R; }
#define AMX_EXTRA , ub
                        AMX_SWITCH(R, amx_rows4, cr);
#undef AMX_EXTRA
                        put_rows(acc, R, r0, t, N, y, out_bf16);
                        continue;
                    }
                    for (int64_t r1 = r0; r1 < r0 + R; r1 += MAX_ROWS) {  /* a few rows left, or no buffer */
                        int R1 = (int)(r0 + R - r1 < MAX_ROWS ? r0 + R - r1 : MAX_ROWS);
                        const int8_t *xr = xq + r1 * K;
                        const float *dr = d + r1 * nb, *cr = c + r1 * nb;
                        ROWS_SWITCH(R1, tile_rows, cr);
                        put_rows(acc, R1, r1, t, N, y, out_bf16);
                    }
                }
                if (lp) lora_tile(lp, t, (uint16_t *)y, N);
            }
            if (shape) _tile_release();
            if (lp) lora_rest(lp, (uint16_t *)y, N);
        }
        return;
    }
#endif
    #pragma omp parallel num_threads(threads)
    {
        if (lp) lora_u_items(lp);
        #pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *w = packed + t * nb * TILE_BYTES;
            float acc[MAX_ROWS * TILE];
            for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
                int R = (int)(M - r0 < MAX_ROWS ? M - r0 : MAX_ROWS);
                const int8_t *xr = xq + r0 * K;
                const float *dr = d + r0 * nb, *cr = c + r0 * nb;
                ROWS_SWITCH(R, tile_rows, cr);
                put_rows(acc, R, r0, t, N, y, out_bf16);
            }
            if (lp) lora_tile(lp, t, (uint16_t *)y, N);
        }
        if (lp) lora_rest(lp, (uint16_t *)y, N);
    }
}

void w4a8_mm(const int8_t *xq, const float *d, const float *c, int64_t M, int64_t K, const uint8_t *packed,
             int64_t N, void *y, int out_bf16, int threads) {
    mm_impl(xq, d, c, M, K, packed, N, y, out_bf16, threads, NULL);
}

/* This thread's quantized activations: xq [M, K], then *d, *c (w4a8's) and *sx (w8a8's, and the
 * draft LoRA's beside w4a8's c) [M, K/32], in one buffer grown as needed and kept (a forward makes
 * ~120 matmul calls; each had malloc'd and freed three buffers). NULL when memory runs out. */
static __thread uint8_t *act_buf = NULL;
static __thread size_t act_cap = 0;
static int8_t *act_scratch(int64_t M, int64_t K, float **d, float **c, int32_t **sx) {
    size_t head = ((size_t)(M * K) + 63) / 64 * 64, need = head + 3 * (size_t)(M * (K / BLOCK)) * 4;
    if (need > act_cap) {
        uint8_t *b = (uint8_t *)realloc(act_buf, need);
        if (!b) return NULL;
        act_buf = b;
        act_cap = need;
    }
    *d = (float *)(act_buf + head);
    *c = *d + M * (K / BLOCK);
    *sx = (int32_t *)(*c + M * (K / BLOCK));
    return (int8_t *)act_buf;
}

/* One call per matmul: quantize x's rows, then multiply. */
int w4a8_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *packed, int64_t N, void *y,
                int out_bf16, int threads) {
    float *d, *c;
    int32_t *sx;
    int8_t *xq = act_scratch(M, K, &d, &c, &sx);
    if (!xq) return 1;
    w4a8_quantize(x, x_bf16, M, K, xq, d, c, NULL, threads);
    w4a8_mm(xq, d, c, M, K, packed, N, y, out_bf16, threads);
    return 0;
}

#include "w8a8.h"
#include "lora8.h"
