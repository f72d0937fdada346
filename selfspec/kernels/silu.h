/* silu(g) * u on bf16 values, one element at a time in plain C: the numbers layer.c's
 * layer_silu_mul gives (`layer.py`'s silu_mul is its torch twin); silu_avx2.h has the same steps
 * 8 lanes at a time. */
#ifndef SELFSPEC_SILU_H
#define SELFSPEC_SILU_H
#include "common.h"

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
#endif
