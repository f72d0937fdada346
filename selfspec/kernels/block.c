/* Every decoder layer of a narrow exact round in one C call: the same kernel calls, with the same
 * arguments in the same order, as the runtime's Python layer loop (`engine/forward/forward.py`,
 * `_exact_layers`) makes for w4a8 weights and the one-call attention (`attn16_direct`), so the
 * same bits by construction. What it saves is the loop's own cost: about ten calls a layer through
 * ctypes and torch (tensor allocation, views, checks), a large share of a one-token forward of
 * the default model on a small CPU.
 *
 * The kernels come in as function pointers (their libraries, `w4a8.c`, `attn16.c` and `layer.c`,
 * are built and loaded on their own); per layer i, in order:
 *   x = rms(h, ln1[0])                         (layer 0 only: later layers get it from the last step)
 *   qkv = w4a8(x, qkv[i]); xr = rope(qkv)      (q, k and v heads onto the attention grids)
 *   a = direct(xr, cache rows of layer i)      (K / V stored, then attention over the row's slots)
 *   o = w4a8(a, wo[i]); x = add_rms(h, o, ln2[i])
 *   gu = w4a8(x, gate_up[i]); m = silu_mul(gu[:, :F], gu[:, F:]); d = w4a8(m, down[i])
 *   x = add_rms(h, d, norm[i])                 (norm[i]: ln1[i + 1], or the final norm into fp32)
 * With a draft LoRA, each of the four matmuls' outputs gets its group's delta on the draft rows
 * inside the matmul's call (`w4a8_linear_lora`, `lora8.h`): the bits of the loop's
 * `LoRA.add_fused`, which adds it in a call of its own. */
#include <stdint.h>
#include <stdlib.h>

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
typedef int (*linear_lora_t)(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N, uint16_t *y,
                             int threads, int nm, const void *const *t, const int64_t *ranks, const int64_t *widths,
                             const int64_t *rows, int64_t n);

typedef struct {
    direct_t direct;
    rms_t rms;
    add_rms_t add_rms;
    rope_t rope;
    silu_mul_t silu_mul;
    linear_lora_t linear;
} kernels_t;

/* y [M, N] = x [M, K] (bf16) times packed [N, K] (w4a8), plus the draft LoRA of layer i's group g
 * (0 q|k|v, 1 o, 2 gate|up, 3 down: lab[28 i + 4 m ..], lr[7 i + m] for its modules m) on the
 * draft rows, where there is one (nl > 0) */
#define LINEAR(g, xin, K, wt, N, y) linear(kn, g, i, xin, M, K, wt, N, y, lab, lr, lrows, nl, nq, KV, D, F, H, threads)

static int linear(const kernels_t *kn, int g, int64_t i, const uint16_t *x, int64_t M, int64_t K, const uint8_t *wt,
                  int64_t N, uint16_t *y, const void *const *lab, const int64_t *lr, const int64_t *lrows, int64_t nl,
                  int64_t nq, int64_t KV, int64_t D, int64_t F, int64_t H, int threads) {
    static const int first[5] = {0, 3, 4, 6, 7};
    const int64_t width[7] = {nq * D, KV * D, KV * D, H, F, F, H};
    int m = first[g];
    return kn->linear(x, M, K, wt, N, y, threads, first[g + 1] - m, nl ? lab + 28 * i + 4 * m : NULL,
                      nl ? lr + 7 * i + m : NULL, width + m, lrows, nl);
}

/* shape: R rows of w tokens (M = R w), hidden H, nq query and KV key / value heads of D, MLP width
 * F. Per layer i: weights[4 i ..] = packed qkv, wo, gate_up, down; norms[2 i], norms[2 i + 1] =
 * ln1 (ln1 of layer 0 for the first rms), the norm after the attention (ln2); next[i] = the norm
 * the layer's last add_rms applies; kv[4 i ..] = K, V, K shifts, V shifts of cache row `row`
 * (already offset); grid[3 i ..] = scale, shift, vscale of the layer's attention; lab[28 i + 4 m ..]
 * = the int8 tables of LoRA module m of layer i (q k v o gate up down; `lora8.h`: A, its scales,
 * scale B, its scales; NULL: none), lr[7 i + m]
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
                 const void *const *lab, const int64_t *lr, const int64_t *lrows, int64_t nl, int threads, int kb) {
    int64_t M = R * w, heads = nq + 2 * KV;
    uint16_t *x = malloc((size_t)(M * H) * 2), *qkv = malloc((size_t)(M * heads * D) * 2);
    uint16_t *a = malloc((size_t)(M * nq * D) * 2), *o = malloc((size_t)(M * H) * 2);
    uint16_t *gu = malloc((size_t)(M * 2 * F) * 2), *m = malloc((size_t)(M * F) * 2);
    double *xr = malloc((size_t)(M * heads * D) * sizeof(double));
    int err = !(x && qkv && a && o && gu && m && xr);
    kn->rms(h, M, H, norms[0], eps, x, 1, threads);
    for (int64_t i = 0; i < L && !err; i++) {
        const uint8_t *const *wi = weights + 4 * i;
        const void *const *c = kv + 4 * i;
        const double *g = grid + 3 * i;
        int last = i == L - 1;
        err = LINEAR(0, x, H, wi[0], heads * D, qkv);
        if (err) break;
        kn->rope(qkv, pos, M, nq, KV, KV, D, tables[0], tables[1], tables[2], tables[3], rope_vscale, xr, threads);
        err = kn->direct(xr, R, w, nq, KV, D, starts, S, c[0], c[1], crs, chs, c[2], c[3], srs, shs, mask, mrs, mts,
                         g[0], g[1], g[2], a, threads, kb)
              || LINEAR(1, a, nq * D, wi[1], H, o);
        if (err) break;
        kn->add_rms(h, o, M, H, norms[2 * i + 1], eps, x, 1, threads);
        err = LINEAR(2, x, H, wi[2], 2 * F, gu);
        if (err) break;
        kn->silu_mul(gu, gu + F, M, F, 2 * F, m, threads);
        err = LINEAR(3, m, F, wi[3], H, o);
        if (err) break;
        kn->add_rms(h, o, M, H, next[i], eps, last ? (void *)out : (void *)x, !last, threads);
    }
    free(x); free(qkv); free(a); free(o); free(gu); free(m); free(xr);
    return err ? 1 : 0;
}
