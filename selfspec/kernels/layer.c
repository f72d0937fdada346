/* The exact formats' elementwise layer steps in C: the runtime's decoder layer calls one of these
 * where torch would run five to fifteen small ops (each paying torch's dispatch, a large share of
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
 *             exact attention's grids (`engine/forward/attention.py`)
 *   silu_mul: s = bf16(g / (1 + e^-g))  (fp32, e^ a fixed Horner polynomial: exp_silu),
 *             m = bf16(s * u)  (a product of two bf16 values is exact in fp32)
 * Every row is computed alone, so a row's result is the same bits in any batch or width. The
 * draft LoRA (draft rows only) is w4a8.c's (lora8.h); the greedy argmax and the Gumbel candidates
 * are sample.c's. */
#include "common.h"
#include "silu.h"
#include "silu_avx2.h"

/* elements below which a step runs on one thread. Inside a forward the team is awake (it spins
 * between the matmuls), so a region is cheap: from 4 rows of the hidden size (2,304) or 2 of the
 * MLP's (3,072) the rows share out; one token's steps stay on one thread, their only row */
static int64_t par_min = 2048;
#define PAR_MIN par_min

/* Sets PAR_MIN, returns the previous value: for tests (a row's bits are the same on any thread)
 * and A/B timing in one process. */
int64_t layer_set_par_min(int64_t v) {
    int64_t old = par_min;
    par_min = v;
    return old;
}
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
