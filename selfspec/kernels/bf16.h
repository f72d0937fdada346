/* bf16 <-> fp32 as torch converts them, shared by the kernels (included by each .c file; the
 * build key and `build.sources_key` read this header too). */
#ifndef SELFSPEC_BF16_H
#define SELFSPEC_BF16_H
#include <stdint.h>
#include <string.h>

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
#endif
