/* Every decoder layer of a narrow exact round in one C call: the same kernel calls, with the same
 * arguments in the same order, as the runtime's Python layer loop (`engine/forward.py`,
 * `_exact_layers`) makes for w4a8 weights and the one-call attention (`attn16_direct`), so the
 * same bits by construction. What it saves is the loop's own cost: about ten calls a layer through
 * ctypes and torch (tensor allocation, views, checks), each a few microseconds on a small CPU,
 * nearly half of a one-token forward of the default model.
 *
 * The kernels come in as function pointers (their libraries, `w4a8.c`, `attn16.c` and `layer.c`,
 * are built and loaded on their own); per layer i, in order:
 *   x = rms(h, ln1[0])                         (layer 0 only: later layers get it from the last step)
 *   qkv = w4a8(x, qkv[i]); xs = rope(qkv)      (q, k and v heads onto the attention grids)
 *   a = direct(xs, cache rows of layer i)      (K / V stored, then attention over the row's slots)
 *   o = w4a8(a, wo[i]); x = add_rms(h, o, ln2[i])
 *   gu = w4a8(x, gate_up[i]); m = silu_mul(gu[:, :F], gu[:, F:]); d = w4a8(m, down[i])
 *   x = add_rms(h, d, norm[i])                 (norm[i]: ln1[i + 1], or the final norm into fp32)
 * With a draft LoRA, each of the four matmuls' outputs gets its group's delta on the draft rows
 * (`lora`, `layer.c`'s layer_lora) right after it, as the loop adds it (`LoRA.add_fused`). */
#include <stdint.h>
#include <stdlib.h>

typedef int (*linear_t)(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *packed, int64_t N, void *y,
                        int out_bf16, int threads);
typedef int (*direct_t)(const double *x, int64_t R, int64_t w, int64_t nq, int64_t KV, int64_t D,
                        const int64_t *starts, int64_t S, const void *k, const void *v, int64_t crs, int64_t chs,
                        const void *ks, const void *vs, int64_t srs, int64_t shs, const double *mask, int64_t mrs,
                        int64_t mts, double scale, double shift, double vscale, void *out, int threads, int kb);
typedef void (*rms_t)(const float *h, int64_t M, int64_t H, const float *w, double eps, void *out, int out_bf16,
                      int threads);
typedef void (*add_rms_t)(float *h, const uint16_t *o, int64_t M, int64_t H, const float *w, double eps, void *out,
                          int out_bf16, int threads);
typedef void (*rope_t)(const uint16_t *x, const int64_t *pos, int64_t M, int64_t nq, int64_t nk, int64_t nv, int64_t D,
                       const double *q_cos, const double *q_sin, const double *k_cos, const double *k_sin,
                       double vscale, double *out, int threads);
typedef void (*silu_mul_t)(const uint16_t *g, const uint16_t *u, int64_t M, int64_t F, int64_t stride, uint16_t *out,
                           int threads);
typedef int (*lora_t)(const uint16_t *x, int64_t ldx, int64_t K, const float *at, int64_t r, const float *bt, int64_t N,
                      uint16_t *out, int64_t ldo, const int64_t *rows, int64_t n, int threads);

typedef struct {
    linear_t linear;
    direct_t direct;
    rms_t rms;
    add_rms_t add_rms;
    rope_t rope;
    silu_mul_t silu_mul;
    lora_t lora;
} kernels_t;

/* the draft LoRA of layer i's group g (0 q|k|v, 1 o, 2 gate|up, 3 down) on out [M, N], module by
 * module on its columns (7 a layer: lab[14 i + 2 m], lr[7 i + m]), if any */
#define LORA(g, xin, K, out, N) (nl ? lora_group(kn, g, i, xin, K, out, N, lab, lr, lrows, nl, nq, KV, D, F, H, threads) : 0)

static int lora_group(const kernels_t *kn, int g, int64_t i, const uint16_t *xin, int64_t K, uint16_t *out,
                      int64_t N, const float *const *lab, const int64_t *lr, const int64_t *lrows, int64_t nl,
                      int64_t nq, int64_t KV, int64_t D, int64_t F, int64_t H, int threads) {
    static const int first[5] = {0, 3, 4, 6, 7};
    const int64_t width[7] = {nq * D, KV * D, KV * D, H, F, F, H};
    int64_t col = 0;
    for (int m = first[g]; m < first[g + 1]; m++) {
        const float *at = lab[14 * i + 2 * m];
        if (at && kn->lora(xin, K, K, at, lr[7 * i + m], lab[14 * i + 2 * m + 1], width[m], out + col, N, lrows, nl,
                           threads))
            return 1;
        col += width[m];
    }
    return 0;
}

/* shape: R rows of w tokens (M = R w), hidden H, nq query and KV key / value heads of D, MLP width
 * F. Per layer i: weights[4 i ..] = packed qkv, wo, gate_up, down; norms[2 i], norms[2 i + 1] =
 * ln1 (ln1 of layer 0 for the first rms), the norm after the attention (ln2); next[i] = the norm
 * the layer's last add_rms applies; kv[4 i ..] = K, V, K shifts, V shifts of cache row `row`
 * (already offset); grid[3 i ..] = scale, shift, vscale of the layer's attention; lab[14 i + 2 m ..]
 * = A^T, scale B^T (fp32) of LoRA module m of layer i (q k v o gate up down; NULL: none), lr[7 i + m]
 * its rank, lrows
 * [nl] the draft rows (flat; nl = 0: no LoRA); kb: bytes a cached value takes (2: int16, 1: int8,
 * the one-byte cache). h [M, H] fp32,
 * the residual stream, updated in place; out [M, H] fp32: the final norm's output. Returns 0, or
 * 1 when memory ran out (nothing of the cache is then certain: the caller raises). */
int block_layers(const kernels_t *kn, int64_t L, int64_t R, int64_t w, int64_t H, int64_t nq, int64_t KV, int64_t D,
                 int64_t F, const uint8_t *const *weights, const float *const *norms, const float *const *next,
                 const void *const *kv, const double *grid, int64_t crs, int64_t chs, int64_t srs, int64_t shs,
                 const int64_t *starts, int64_t S, const double *mask, int64_t mrs, int64_t mts, const int64_t *pos,
                 const double *const *tables, double rope_vscale, double eps, float *h, float *out,
                 const float *const *lab, const int64_t *lr, const int64_t *lrows, int64_t nl, int threads, int kb) {
    int64_t M = R * w, heads = nq + 2 * KV;
    uint16_t *x = malloc((size_t)(M * H) * 2), *qkv = malloc((size_t)(M * heads * D) * 2);
    uint16_t *a = malloc((size_t)(M * nq * D) * 2), *o = malloc((size_t)(M * H) * 2);
    uint16_t *gu = malloc((size_t)(M * 2 * F) * 2), *m = malloc((size_t)(M * F) * 2);
    double *xs = malloc((size_t)(M * heads * D) * sizeof(double));
    int err = !(x && qkv && a && o && gu && m && xs);
    kn->rms(h, M, H, norms[0], eps, x, 1, threads);
    for (int64_t i = 0; i < L && !err; i++) {
        const uint8_t *const *wi = weights + 4 * i;
        const void *const *c = kv + 4 * i;
        const double *g = grid + 3 * i;
        int last = i == L - 1;
        err = kn->linear(x, 1, M, H, wi[0], heads * D, qkv, 1, threads) || LORA(0, x, H, qkv, heads * D);
        if (err) break;
        kn->rope(qkv, pos, M, nq, KV, KV, D, tables[0], tables[1], tables[2], tables[3], rope_vscale, xs, threads);
        err = kn->direct(xs, R, w, nq, KV, D, starts, S, c[0], c[1], crs, chs, c[2], c[3], srs, shs, mask, mrs, mts,
                         g[0], g[1], g[2], a, threads, kb)
              || kn->linear(a, 1, M, nq * D, wi[1], H, o, 1, threads) || LORA(1, a, nq * D, o, H);
        if (err) break;
        kn->add_rms(h, o, M, H, norms[2 * i + 1], eps, x, 1, threads);
        err = kn->linear(x, 1, M, H, wi[2], 2 * F, gu, 1, threads) || LORA(2, x, H, gu, 2 * F);
        if (err) break;
        kn->silu_mul(gu, gu + F, M, F, 2 * F, m, threads);
        err = kn->linear(m, 1, M, F, wi[3], H, o, 1, threads) || LORA(3, m, F, o, H);
        if (err) break;
        kn->add_rms(h, o, M, H, next[i], eps, last ? (void *)out : (void *)x, !last, threads);
    }
    free(x); free(qkv); free(a); free(o); free(gu); free(m); free(xs);
    return err ? 1 : 0;
}
