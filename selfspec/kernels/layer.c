/* The exact formats' elementwise layer steps in C: the runtime's decoder layer calls one of these
 * where torch would run five to fifteen small ops (each ~5-10 us of dispatch on a CPU, a third of
 * a width-1 forward of a small model). `layer.py` holds the same numerics in torch ops (the
 * fallback; tests compare the bits), so every step is a fixed sequence of IEEE operations
 * (built with -ffp-contract=off):
 *
 *   rms:      ss = sum of x^2 in float64, in index order (each x^2 of an fp32 x is exact in
 *             float64; torch's cumsum adds in the same order); r = 1 / sqrt(ss / H + eps);
 *             y = (float)(x * r) * w  (fp32), then bf16 (round to nearest even) or kept fp32
 *   add_rms:  h += (float) o  (the residual, in place), then rms of the new h
 *   rope:     y = rint(x * cos + x[(d + D/2) % D] * sin) in float64 with the query, key or value
 *             head's tables (value heads: cos = their grid scale, sin = 0): q, k and v onto the
 *             exact attention's grids (`engine/attention.py`)
 *   silu_mul: s = bf16(g / (1 + e^-g))  (fp32, e^ a fixed Horner polynomial: exp_silu),
 *             m = bf16(s * u)  (a product of two bf16 values is exact in fp32)
 * Every row is computed alone, so a row's result is the same bits in any batch or width. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include "bf16.h"

#define PAR_MIN 16384  /* elements below which a step runs on one thread (a team costs more) */
#define D_MAX 256

static inline void rms_row(const float *x, int64_t H, const float *w, double eps, void *out, int64_t m, int out_bf16) {
    double ss = 0.0;
    for (int64_t i = 0; i < H; i++) ss = ss + (double)x[i] * (double)x[i];
    double r = 1.0 / sqrt(ss / (double)H + eps);
    if (out_bf16) {
        uint16_t *o = (uint16_t *)out + m * H;
        for (int64_t i = 0; i < H; i++) o[i] = float_to_bf16((float)((double)x[i] * r) * w[i]);
    } else {
        float *o = (float *)out + m * H;
        for (int64_t i = 0; i < H; i++) o[i] = (float)((double)x[i] * r) * w[i];
    }
}

void layer_rms(const float *h, int64_t M, int64_t H, const float *w, double eps, void *out, int out_bf16,
               int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (M * H >= PAR_MIN)
    for (int64_t m = 0; m < M; m++) rms_row(h + m * H, H, w, eps, out, m, out_bf16);
}

void layer_add_rms(float *h, const uint16_t *o, int64_t M, int64_t H, const float *w, double eps, void *out,
                   int out_bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (M * H >= PAR_MIN)
    for (int64_t m = 0; m < M; m++) {
        float *x = h + m * H;
        const uint16_t *om = o + m * H;
        for (int64_t i = 0; i < H; i++) x[i] = x[i] + bf16_to_float(om[i]);
        rms_row(x, H, w, eps, out, m, out_bf16);
    }
}

/* x [M, (nq + nk + nv) * D] bf16 (the fused q/k/v projection), pos [M]; tables [positions, D]
 * float64 -> out [M, nq + nk + nv, D] float64 grid integers */
void layer_rope(const uint16_t *x, const int64_t *pos, int64_t M, int64_t nq, int64_t nk, int64_t nv, int64_t D,
                const double *q_cos, const double *q_sin, const double *k_cos, const double *k_sin, double vscale,
                double *out, int threads) {
    int64_t heads = nq + nk + nv, half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (M * heads * D >= PAR_MIN)
    for (int64_t m = 0; m < M; m++) {
        double vc[D_MAX], vs[D_MAX];
        for (int64_t d = 0; d < D; d++) { vc[d] = vscale; vs[d] = 0.0; }
        for (int64_t hd = 0; hd < heads; hd++) {
            const uint16_t *xh = x + (m * heads + hd) * D;
            double *oh = out + (m * heads + hd) * D;
            const double *c = hd < nq ? q_cos + pos[m] * D : (hd < nq + nk ? k_cos + pos[m] * D : vc);
            const double *s = hd < nq ? q_sin + pos[m] * D : (hd < nq + nk ? k_sin + pos[m] * D : vs);
            #pragma omp simd
            for (int64_t d = 0; d < half; d++)
                oh[d] = nearbyint((double)bf16_to_float(xh[d]) * c[d] + (double)bf16_to_float(xh[d + half]) * s[d]);
            #pragma omp simd
            for (int64_t d = half; d < D; d++)
                oh[d] = nearbyint((double)bf16_to_float(xh[d]) * c[d] + (double)bf16_to_float(xh[d - half]) * s[d]);
        }
    }
}

/* silu's exponential in fp32 (its result is rounded to bf16): Cody-Waite reduction, a degree-7
 * Taylor polynomial by Horner's rule, 2^k from its bits; |x| clamped to [-87, 88] (2^k normal) */
#define SILU_LO (-87.0f)
#define SILU_HI 88.0f
#define INV_LN2F 1.44269502162933349609375f
#define LN2_HIF 0.693359375f
#define LN2_LOF (-2.12194440160132944584e-4f)

static inline float exp_silu(float y) {
    y = y > SILU_HI ? SILU_HI : y;
    y = y < SILU_LO ? SILU_LO : y;
    float k = rintf(y * INV_LN2F);
    float r = (y - k * LN2_HIF) - k * LN2_LOF;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720; p = p * r + 1.0f / 120; p = p * r + 1.0f / 24; p = p * r + 1.0f / 6;
    p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float t;
    memcpy(&t, &bits, 4);
    return p * t;
}

static inline uint16_t silu_mul1(uint16_t g, uint16_t u) {
    float x = bf16_to_float(g);
    float s = bf16_to_float(float_to_bf16(x / (1.0f + exp_silu(-x))));
    return float_to_bf16(s * bf16_to_float(u));
}

#if defined(__AVX2__)
#include <immintrin.h>
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

/* g, u [M, F] bf16 rows `stride` elements apart (the halves of the fused gate/up output) ->
 * out [M, F] bf16 */
void layer_silu_mul(const uint16_t *g, const uint16_t *u, int64_t M, int64_t F, int64_t stride, uint16_t *out,
                    int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (M * F >= PAR_MIN)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *gm = g + m * stride, *um = u + m * stride;
        uint16_t *om = out + m * F;
        int64_t i = 0;
#if defined(__AVX2__)
        for (; i + 8 <= F; i += 8) {
            __m256 x = bf16x8_to_ps(gm + i);
            __m256 e = exp_silu8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
            __m256 q = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            __m256 sb = _mm256_castsi256_ps(_mm256_slli_epi32(ps_to_bf16_bits(q), 16));
            __m256i y = ps_to_bf16_bits(_mm256_mul_ps(sb, bf16x8_to_ps(um + i)));
            __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
            _mm_storeu_si128((__m128i *)(om + i), packed);
        }
#endif
        for (; i < F; i++) om[i] = silu_mul1(gm[i], um[i]);
    }
}

/* The draft LoRA's delta on some rows of a projection's output (`checkpoint/lora.py`; draft rows
 * only, so no exactness rests on it: it is fixed so that the layer loop and the one-call block
 * give the drafts the same bits, with or without a compiler). For each row m of rows[0 .. n-1]:
 *   u = x[m] @ at     (x bf16 [K], at fp32 [K, r]): u_j = x_0 a_0j, then u_j + x_k a_kj for k = 1, 2, ...
 *   d = u @ bt        (bt fp32 [r, N]): the same in j order
 *   out[m] = bf16((float) out[m] + d)
 * all in fp32, each product rounded before its add (`layer.py`'s twin repeats the order). x rows
 * ldx elements apart, out rows ldo apart (a fused projection's output, in place). Returns nonzero
 * when scratch cannot be had (nothing written). */
#define LORA_COLS 64
#if defined(__AVX2__)
/* u = x @ at for r = 8 RB (RB <= 8) in registers: the same products and adds, in the same order,
 * as the scalar loop (each lane is one j) */
static inline __attribute__((always_inline)) void lora_u_rb(const uint16_t *xi, int64_t K, const float *at, int RB,
                                                             float *ui) {
    __m256 acc[8];
    __m256 x0 = _mm256_set1_ps(bf16_to_float(xi[0]));
    for (int b = 0; b < RB; b++) acc[b] = _mm256_mul_ps(x0, _mm256_loadu_ps(at + 8 * b));
    for (int64_t k = 1; k < K; k++) {
        __m256 xk = _mm256_set1_ps(bf16_to_float(xi[k]));
        const float *ak = at + k * 8 * RB;
        for (int b = 0; b < RB; b++) acc[b] = _mm256_add_ps(acc[b], _mm256_mul_ps(xk, _mm256_loadu_ps(ak + 8 * b)));
    }
    for (int b = 0; b < RB; b++) _mm256_storeu_ps(ui + 8 * b, acc[b]);
}

static void lora_u8(const uint16_t *xi, int64_t K, const float *at, int64_t r, float *ui) {
    switch (r / 8) {
        case 1: lora_u_rb(xi, K, at, 1, ui); break;
        case 2: lora_u_rb(xi, K, at, 2, ui); break;
        case 3: lora_u_rb(xi, K, at, 3, ui); break;
        case 4: lora_u_rb(xi, K, at, 4, ui); break;
        case 5: lora_u_rb(xi, K, at, 5, ui); break;
        case 6: lora_u_rb(xi, K, at, 6, ui); break;
        case 7: lora_u_rb(xi, K, at, 7, ui); break;
        default: lora_u_rb(xi, K, at, 8, ui); break;
    }
}

/* 64 columns of out += u @ bt (bt's columns start at bt, rows N apart), sums in registers in j
 * order, then added to the bf16 output: the scalar loop's steps, eight columns a lane each */
static void lora_d64(const float *ui, int64_t r, const float *bt, int64_t N, uint16_t *o) {
    __m256 acc[8];
    __m256 u0 = _mm256_set1_ps(ui[0]);
    for (int t = 0; t < 8; t++) acc[t] = _mm256_mul_ps(u0, _mm256_loadu_ps(bt + 8 * t));
    for (int64_t j = 1; j < r; j++) {
        __m256 uj = _mm256_set1_ps(ui[j]);
        const float *bj = bt + j * N;
        for (int t = 0; t < 8; t++) acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(uj, _mm256_loadu_ps(bj + 8 * t)));
    }
    for (int t = 0; t < 8; t++) {
        __m256i y = ps_to_bf16_bits(_mm256_add_ps(bf16x8_to_ps(o + 8 * t), acc[t]));
        _mm_storeu_si128((__m128i *)(o + 8 * t), _mm_packus_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1)));
    }
}
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The same per-lane steps sixteen lanes wide, several rows at once: each row's sums are their own
 * chain of adds in the scalar loop's order, and rows side by side keep the adds' latency hidden
 * (one row's r = 16 sums alone are one register: every add waited for the last). Width-17 rounds
 * of the default model with the LoRA on their 16 mask rows: see `benchmarks/lora_cost.py`. */
#define LORA_ROWS 8

/* u [G][16 RB] = xf [G][K] (fp32 rows, K apart) @ at [K, 16 RB] */
static inline __attribute__((always_inline)) void lora_u_z(const float *xf, int64_t K, const float *at, int RB,
                                                            int G, float *u) {
    __m512 acc[LORA_ROWS];
    for (int g = 0; g < G; g++)
        for (int b = 0; b < RB; b++) acc[g * RB + b] = _mm512_mul_ps(_mm512_set1_ps(xf[g * K]), _mm512_loadu_ps(at + 16 * b));
    for (int64_t k = 1; k < K; k++) {
        const float *ak = at + k * 16 * RB;
        for (int b = 0; b < RB; b++) {
            __m512 a = _mm512_loadu_ps(ak + 16 * b);
            for (int g = 0; g < G; g++)
                acc[g * RB + b] = _mm512_add_ps(acc[g * RB + b], _mm512_mul_ps(_mm512_set1_ps(xf[g * K + k]), a));
        }
    }
    for (int g = 0; g < G; g++)
        for (int b = 0; b < RB; b++) _mm512_storeu_ps(u + g * 16 * RB + 16 * b, acc[g * RB + b]);
}

#define LORA_U_CASE(RB, G) case G: lora_u_z(xf, K, at, RB, G, u); break;
static void lora_u_rows(const float *xf, int64_t K, const float *at, int64_t r, int G, float *u) {
    switch (r / 16) {
        case 1: switch (G) { LORA_U_CASE(1, 8) LORA_U_CASE(1, 7) LORA_U_CASE(1, 6) LORA_U_CASE(1, 5) LORA_U_CASE(1, 4)
                             LORA_U_CASE(1, 3) LORA_U_CASE(1, 2) default: lora_u_z(xf, K, at, 1, 1, u); break; } break;
        case 2: switch (G) { LORA_U_CASE(2, 4) LORA_U_CASE(2, 3) LORA_U_CASE(2, 2) default: lora_u_z(xf, K, at, 2, 1, u); break; }
                break;
        case 3: switch (G) { LORA_U_CASE(3, 2) default: lora_u_z(xf, K, at, 3, 1, u); break; } break;
        default: switch (G) { LORA_U_CASE(4, 2) default: lora_u_z(xf, K, at, 4, 1, u); break; } break;
    }
}

static inline __m256i ps_to_bf16_z(__m512 f) {  /* float_to_bf16 per lane */
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __mmask16 isnan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                              _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, isnan, nan));
}

/* 64 columns of out += u @ bt for two rows (u0, o0 and u1, o1): lora_d64's steps, 16 lanes wide */
static inline __attribute__((always_inline)) void lora_d64_z(const float *u0, const float *u1, int NR, int64_t r,
                                                              const float *bt, int64_t N, uint16_t *o0, uint16_t *o1) {
    __m512 acc[2][4];
    for (int t = 0; t < 4; t++) {
        __m512 b = _mm512_loadu_ps(bt + 16 * t);
        acc[0][t] = _mm512_mul_ps(_mm512_set1_ps(u0[0]), b);
        if (NR == 2) acc[1][t] = _mm512_mul_ps(_mm512_set1_ps(u1[0]), b);
    }
    for (int64_t j = 1; j < r; j++) {
        const float *bj = bt + j * N;
        for (int t = 0; t < 4; t++) {
            __m512 b = _mm512_loadu_ps(bj + 16 * t);
            acc[0][t] = _mm512_add_ps(acc[0][t], _mm512_mul_ps(_mm512_set1_ps(u0[j]), b));
            if (NR == 2) acc[1][t] = _mm512_add_ps(acc[1][t], _mm512_mul_ps(_mm512_set1_ps(u1[j]), b));
        }
    }
    for (int i = 0; i < NR; i++) {
        uint16_t *o = i ? o1 : o0;
        for (int t = 0; t < 4; t++) {
            __m512 prev = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(o + 16 * t))), 16));
            _mm256_storeu_si256((__m256i *)(o + 16 * t), ps_to_bf16_z(_mm512_add_ps(prev, acc[i][t])));
        }
    }
}

/* layer_lora's two steps for r = 16, 32, 48 or 64, rows in groups of LORA_ROWS / (r / 16) (at least 2) */
static int lora_z(const uint16_t *x, int64_t ldx, int64_t K, const float *at, int64_t r, const float *bt, int64_t N,
                  uint16_t *out, int64_t ldo, const int64_t *rows, int64_t n, int threads) {
    int G = LORA_ROWS / (int)(r / 16) > 2 ? LORA_ROWS / (int)(r / 16) : 2;
    int64_t groups = (n + G - 1) / G;
    float *u = (float *)malloc((size_t)(n * r) * sizeof(float)), *xf = (float *)malloc((size_t)(n * K) * sizeof(float));
    if (!u || !xf) { free(u); free(xf); return 1; }
    #pragma omp parallel num_threads(threads) if (n * N * r >= 4 * PAR_MIN)
    {
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < groups; q++) {
            int64_t i0 = q * G;
            int g = (int)(n - i0 < G ? n - i0 : G);
            for (int i = 0; i < g; i++)
                for (int64_t k = 0; k < K; k++) xf[(i0 + i) * K + k] = bf16_to_float(x[rows[i0 + i] * ldx + k]);
            lora_u_rows(xf + i0 * K, K, at, r, g, u + i0 * r);
        }
        int64_t chunks = (N + LORA_COLS - 1) / LORA_COLS;
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t c0 = c * LORA_COLS, cn = N - c0 < LORA_COLS ? N - c0 : LORA_COLS;
            if (c0 + 2 * LORA_COLS <= N)  /* the next chunk's r rows, N apart: no stream the hardware follows */
                for (int64_t j = 0; j < r; j++)
                    for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(bt + j * N + c0 + LORA_COLS + 16 * l), _MM_HINT_T0);
            for (int64_t i = 0; i < n; i += 2) {  /* the chunk of bt stays in L1 for every row */
                int NR = n - i >= 2 ? 2 : 1;
                const float *u0 = u + i * r, *u1 = u + (i + NR - 1) * r;
                uint16_t *o0 = out + rows[i] * ldo + c0, *o1 = out + rows[i + NR - 1] * ldo + c0;
                if (cn == LORA_COLS) {
                    if (NR == 2) lora_d64_z(u0, u1, 2, r, bt + c0, N, o0, o1);
                    else lora_d64_z(u0, u0, 1, r, bt + c0, N, o0, o0);
                    continue;
                }
                for (int k = 0; k < NR; k++) {
                    const float *ui = k ? u1 : u0;
                    uint16_t *o = k ? o1 : o0;
                    float acc[LORA_COLS];
                    for (int64_t t = 0; t < cn; t++) acc[t] = ui[0] * bt[c0 + t];
                    for (int64_t j = 1; j < r; j++)
                        for (int64_t t = 0; t < cn; t++) acc[t] = acc[t] + ui[j] * bt[j * N + c0 + t];
                    for (int64_t t = 0; t < cn; t++) o[t] = float_to_bf16(bf16_to_float(o[t]) + acc[t]);
                }
            }
        }
    }
    free(u); free(xf);
    return 0;
}
#endif
int layer_lora(const uint16_t *x, int64_t ldx, int64_t K, const float *at, int64_t r, const float *bt, int64_t N,
               uint16_t *out, int64_t ldo, const int64_t *rows, int64_t n, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (r % 16 == 0 && r <= 64) return lora_z(x, ldx, K, at, r, bt, N, out, ldo, rows, n, threads);
#endif
    float *u = (float *)malloc((size_t)(n * r) * sizeof(float));
    if (!u) return 1;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * K * r >= 4 * PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
        float *ui = u + i * r;
        const uint16_t *xi = x + rows[i] * ldx;
#if defined(__AVX2__)
        if (r % 8 == 0 && r <= 64) {
            lora_u8(xi, K, at, r, ui);
            continue;
        }
#endif
        float x0 = bf16_to_float(xi[0]);
        for (int64_t j = 0; j < r; j++) ui[j] = x0 * at[j];
        for (int64_t k = 1; k < K; k++) {
            float xk = bf16_to_float(xi[k]);
            const float *ak = at + k * r;
            for (int64_t j = 0; j < r; j++) ui[j] = ui[j] + xk * ak[j];
        }
    }
    int64_t chunks = (N + LORA_COLS - 1) / LORA_COLS;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * N * r >= 4 * PAR_MIN)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t c0 = c * LORA_COLS, cn = N - c0 < LORA_COLS ? N - c0 : LORA_COLS;
        for (int64_t i = 0; i < n; i++) {  /* the chunk of bt stays in L1 for every row */
            float acc[LORA_COLS];
            const float *ui = u + i * r;
            uint16_t *o = out + rows[i] * ldo + c0;
#if defined(__AVX2__)
            if (cn == LORA_COLS) {
                lora_d64(ui, r, bt + c0, N, o);
                continue;
            }
#endif
            for (int64_t t = 0; t < cn; t++) acc[t] = ui[0] * bt[c0 + t];
            for (int64_t j = 1; j < r; j++) {
                float uj = ui[j];
                const float *bj = bt + j * N + c0;
                for (int64_t t = 0; t < cn; t++) acc[t] = acc[t] + uj * bj[t];
            }
            for (int64_t t = 0; t < cn; t++) o[t] = float_to_bf16(bf16_to_float(o[t]) + acc[t]);
        }
    }
    free(u);
    return 0;
}

/* argmax: y[r] = the first index of the largest value of row r of x [M, V] (bf16), the `banned`
 * index counting as -inf (-1: none) and -0 equal to +0, as torch.argmax over the float32 row with
 * x[banned] = -inf gives it; -1 where a row holds a NaN (torch puts NaN above everything: the
 * caller asks torch). Values compare as integers, which the loops vectorise: k(b) = +-(b & 0x7fff)
 * by the sign bit orders bf16 numbers as their values (no NaN). */
static inline int32_t bf16_key(uint16_t b) { return (b & 0x8000) ? -(int32_t)(b & 0x7fff) : (int32_t)(b & 0x7fff); }
#define KEY_NEG_INF (-0x7f80)
#define ARGMAX_BLOCK 64

static int32_t key_max(const uint16_t *x, int64_t a, int64_t b, int32_t m, int *nan) {
    int nn = 0;
    for (int64_t i = a; i < b; i++) {
        int32_t k = bf16_key(x[i]);
        m = k > m ? k : m;
        nn |= (x[i] & 0x7fff) > 0x7f80;
    }
    *nan |= nn;
    return m;
}

void layer_argmax_bf16(const uint16_t *x, int64_t M, int64_t V, int64_t banned, int64_t *y) {
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *row = x + r * V;
        int nan = 0;
        int32_t m = KEY_NEG_INF;
        if (banned >= 0 && banned < V) {
            m = key_max(row, 0, banned, m, &nan);
            m = key_max(row, banned + 1, V, m, &nan);
        } else {
            m = key_max(row, 0, V, m, &nan);
        }
        if (nan) { y[r] = -1; continue; }
        int64_t found = 0;  /* all -inf: index 0, torch's answer */
        for (int64_t b0 = 0; b0 < V; b0 += ARGMAX_BLOCK) {
            int64_t b1 = b0 + ARGMAX_BLOCK < V ? b0 + ARGMAX_BLOCK : V;
            int hit = 0;
            for (int64_t i = b0; i < b1; i++) hit |= bf16_key(row[i]) == m;
            hit |= banned >= b0 && banned < b1 && m == KEY_NEG_INF;
            if (!hit) continue;
            int64_t i = b0;
            for (; i < b1; i++) if ((i == banned ? KEY_NEG_INF : bf16_key(row[i])) == m) break;
            if (i < b1) { found = i; break; }
        }
        y[r] = found;
    }
}

/* gumbel_candidates: for each row r of float32 logits x [M, V] (tempered and filtered; -inf for
 * what may not be drawn), with its position's uniforms u + rows[r] * V and `top[rows[r]]` (the
 * largest noise of that position), the tokens that may win argmax(x + gumbel(u)): lb = x[j] +
 * g(u[j]) at the row's first largest x[j] (here with libm's log, lowered by a margin: a bound,
 * not the value) and every k with x[k] >= lb - top, less a margin. Writes (row, token) pairs to
 * cr / cc (capacity M x per_row) in index order and returns how many; -1 when a row holds a NaN or
 * more than per_row candidates (a flat distribution: the full computation is then cheaper; the
 * caller takes it). The exact values of the candidates are the caller's, in torch
 * (`drafting.sampling.gumbel_argmax`). */
#define CAND_BLOCK 64
int64_t layer_gumbel_candidates(const float *x, int64_t M, int64_t V, const double *u, const int64_t *rows,
                                const double *top, int64_t per_row, int64_t *cr, int64_t *cc) {
    int64_t n = 0;
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * V;
        const double *ur = u + rows[r] * V;
        float best = -INFINITY;
        int nan = 0;
        #pragma omp simd reduction(max:best) reduction(|:nan)
        for (int64_t k = 0; k < V; k++) {  /* the largest value, then its first index: two passes that vectorise */
            float v = row[k];
            nan |= v != v;
            best = v > best ? v : best;
        }
        if (nan) return -1;
        int64_t j = 0;
        for (int64_t b0 = 0; b0 < V; b0 += CAND_BLOCK) {
            int64_t b1 = b0 + CAND_BLOCK < V ? b0 + CAND_BLOCK : V;
            int hit = 0;
            #pragma omp simd reduction(|:hit)
            for (int64_t k = b0; k < b1; k++) hit |= row[k] == best;
            if (!hit) continue;
            for (j = b0; row[j] != best; j++) {}
            break;
        }
        double lb = (double)best - log(-log(ur[j]));
        lb -= 1e-9 * (1.0 + fabs(lb));
        double t = top[rows[r]];
        double thr = lb - t - 1e-9 * (1.0 + fabs(lb) + fabs(t));
        if (!(thr == thr)) thr = -INFINITY;  /* -inf - (-inf) (a row of one finite token and u = 0) */
        int64_t end = n + per_row;
        for (int64_t b0 = 0; b0 < V; b0 += CAND_BLOCK) {  /* blocks with no candidate (most) in one vector pass */
            int64_t b1 = b0 + CAND_BLOCK < V ? b0 + CAND_BLOCK : V;
            int hit = 0;
            #pragma omp simd reduction(|:hit)
            for (int64_t k = b0; k < b1; k++) hit |= (double)row[k] >= thr;
            if (!hit) continue;
            for (int64_t k = b0; k < b1; k++) {
                if ((double)row[k] >= thr) {
                    if (n == end) return -1;
                    cr[n] = r; cc[n] = k; n++;
                }
            }
        }
    }
    return n;
}

/* uniforms: u[i] = ((z_i >> 11) + 0.5) * 2^-53 in (0, 1) for i < V, z_i = splitmix64(seed + (i + 1) *
 * 0x9E3779B97F4A7C15): a position's uniforms (`drafting.sampling.splitmix_uniforms` is the same in
 * torch ops, the bits the tests compare). Every element alone, so the loop vectorises. */
void layer_uniforms(uint64_t seed, int64_t V, double *u) {
    #pragma omp simd
    for (int64_t i = 0; i < V; i++) {
        uint64_t z = seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        u[i] = ((double)(z >> 11) + 0.5) * 0x1p-53;
    }
}
