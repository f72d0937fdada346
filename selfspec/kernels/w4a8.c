/* w4a8 and w8a8 matmuls (the formats and their numerics: w4a8.h) and the draft LoRA riding on them
 * (lora8.h), the entry points `w4a8.py` calls through ctypes. The loops are per instruction set
 * (w4a8_loops.h picks them); from enough rows on a CPU with AMX, tiles (w4a8_amx.h). */
#include "common.h"
#include "w4a8.h"
#include "w4a8_loops.h"
#include "w4a8_amx.h"
#include "lora8.h"

const char *w4a8_isa(void) {  /* which loops tile_rows are (w4a8.h's flags) */
#if defined(W4A8_VNNI)
    return "avx512-vnni";
#elif defined(W4A8_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

/* x [M, K] fp32 or bf16 -> xq [M, K] int8, d [M, K/32], and where not NULL c [M, K/32] (w4a8's
 * d * sum(xq)) and sx [M, K/32] (w8a8's sum(xq)). Rows are independent: a prefill piece's rows are
 * shared out over the threads. */
void w4a8_quantize(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *xq, float *d, float *c, int32_t *sx,
                   int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (M >= 8)
    for (int64_t r = 0; r < M; r++) quantize_row(x, x_bf16, r, K, xq, d, c, sx);
}

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
 * a hundred matmul calls or more; each had malloc'd and freed three buffers). NULL when memory runs out. */
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

/* rows r0.. of a tile's outputs: acc [R][16] times the outputs' scales into y's columns t*16.. */
static inline void put_rows8(const float *acc, int R, int64_t r0, int64_t t, int64_t N, const float *scales, void *y,
                             int out_bf16) {
    int cols = (int)(N - t * TILE < TILE ? N - t * TILE : TILE);
    for (int r = 0; r < R; r++) {
        for (int j = 0; j < cols; j++) {
            float v = acc[r * TILE + j] * scales[t * TILE + j];
            if (out_bf16) ((uint16_t *)y)[(r0 + r) * N + t * TILE + j] = float_to_bf16(v);
            else ((float *)y)[(r0 + r) * N + t * TILE + j] = v;
        }
    }
}

int w8a8_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *packed, const float *scales,
                int64_t N, void *y, int out_bf16, int threads) {
    int64_t nb = K / BLOCK, tiles = (N + TILE - 1) / TILE;
    float *d, *c;
    int32_t *sx;
    int8_t *xq = act_scratch(M, K, &d, &c, &sx);
    if (!xq) return 1;
    w4a8_quantize(x, x_bf16, M, K, xq, d, NULL, sx, threads);
#ifdef W4A8_AMX
    if (amx_use(M, AMX_MIN8, AMX_MAX8)) {
        #pragma omp parallel num_threads(threads)
        {
            int shape = 0;
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                const uint8_t *w = packed + t * nb * TILE_BYTES8;
                float acc[AMX_ROWS * TILE];
                for (int64_t r0 = 0; r0 < M; r0 += AMX_ROWS) {
                    int R = (int)(M - r0 < AMX_ROWS ? M - r0 : AMX_ROWS);
                    if (R >= AMX_GROUP_MIN) {
                        const int8_t *xr = xq + r0 * K;
                        const float *dr = d + r0 * nb;
                        const int32_t *sr = sx + r0 * nb;
                        if (R != shape) { amx_configure(R); shape = R; }
#define AMX_EXTRA , NULL
                        AMX_SWITCH(R, amx_rows8, sr);
#undef AMX_EXTRA
                        put_rows8(acc, R, r0, t, N, scales, y, out_bf16);
                        continue;
                    }
                    for (int64_t r1 = r0; r1 < r0 + R; r1 += MAX_ROWS) {  /* a few rows left */
                        int R1 = (int)(r0 + R - r1 < MAX_ROWS ? r0 + R - r1 : MAX_ROWS);
                        const int8_t *xr = xq + r1 * K;
                        const float *dr = d + r1 * nb;
                        const int32_t *sr = sx + r1 * nb;
                        ROWS_SWITCH(R1, tile_rows8, sr);
                        put_rows8(acc, R1, r1, t, N, scales, y, out_bf16);
                    }
                }
            }
            if (shape) _tile_release();
        }
        return 0;
    }
#endif
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *w = packed + t * nb * TILE_BYTES8;
        float acc[MAX_ROWS * TILE];
        for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
            int R = (int)(M - r0 < MAX_ROWS ? M - r0 : MAX_ROWS);
            const int8_t *xr = xq + r0 * K;
            const float *dr = d + r0 * nb;
            const int32_t *sr = sx + r0 * nb;
            ROWS_SWITCH(R, tile_rows8, sr);
            put_rows8(acc, R, r0, t, N, scales, y, out_bf16);
        }
    }
    return 0;
}

/* x bf16 [M, K] times the packed weight [N, K] into y bf16 [M, N], plus the draft LoRA of the
 * modules whose columns y holds side by side (nm of them, tables t, ranks, widths as lora_plan's)
 * on rows[0 .. n-1] (n = 0: w4a8_linear). The one-call block's matmul. */
int w4a8_linear_lora(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N, uint16_t *y,
                     int threads, int nm, const void *const *t, const int64_t *ranks, const int64_t *widths,
                     const int64_t *rows, int64_t n) {
    float *d, *c;
    int32_t *sx;
    int8_t *xq = act_scratch(M, K, &d, &c, &sx);
    if (!xq) return 1;
    w4a8_quantize(x, 1, M, K, xq, d, c, n ? sx : NULL, threads);
    lora_plan_t plan;
    if (n && lora_plan(&plan, xq, d, sx, K, nm, t, ranks, widths, rows, rows, n)) return 1;
    mm_impl(xq, d, c, M, K, packed, N, y, 1, threads, n && plan.ntiles ? &plan : NULL);
    return 0;
}

/* One module on x bf16 [.., K] (rows ldx apart; the layer loop's): its draft rows quantized here
 * into this thread's activation scratch (straight from bf16; K not a multiple of 32 goes through
 * an fp32 copy with the zeros), then the delta added into out (rows ldo apart). */
int w8a8_lora(const uint16_t *x, int64_t ldx, int64_t K, const uint8_t *pa, const float *sa, int64_t r,
              const uint8_t *pb, const float *sb, int64_t N, uint16_t *out, int64_t ldo, const int64_t *rows,
              int64_t n, int threads) {
    int64_t kp = (K + BLOCK - 1) / BLOCK * BLOCK, nb = kp / BLOCK;
    float *dx, *c;
    int32_t *sx;
    int8_t *xq = act_scratch(n, kp, &dx, &c, &sx);
    float *xf = kp == K ? NULL : (float *)malloc((size_t)(n * kp) * sizeof(float));
    if (!xq || (kp != K && !xf)) { free(xf); return 1; }
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * kp >= 16384)
    for (int64_t i = 0; i < n; i++) {
        if (!xf) {
            quantize_row(x + rows[i] * ldx, 1, 0, kp, xq + i * kp, dx + i * nb, NULL, sx + i * nb);
            continue;
        }
        for (int64_t k = 0; k < kp; k++) xf[i * kp + k] = k < K ? bf16_to_float(x[rows[i] * ldx + k]) : 0.0f;
        quantize_row(xf, 0, i, kp, xq, dx, NULL, sx);
    }
    const void *t[4] = {pa, sa, pb, sb};
    lora_plan_t plan;
    int err = lora_plan(&plan, xq, dx, sx, kp, 1, t, &r, &N, NULL, rows, n);
    if (!err) {
        #pragma omp parallel num_threads(threads) if (n * N >= 4096)
        {
            lora_u_items(&plan);
            #pragma omp for schedule(static) nowait
            for (int64_t it = 0; it < plan.ntiles; it++) lora_add_tile(&plan, it, out, ldo);
        }
    }
    free(xf);
    return err;
}
