/* The draft LoRA on int8 tables: its plan and its steps inside a matmul's thread team (w4a8.c's
 * w4a8_linear_lora and w8a8_lora run them), on w8a8's loops (w4a8_loops.h).
 *
 * Draft rows only (`checkpoint/lora.py`), so no exactness rests on it; its numerics are fixed so
 * that the layer loop, the one-call block and the fallback (`w4a8.py`'s `lora`) give the drafts the
 * same bits. A [r, K] and scale * B [N, r] are w8a8 weights (int8 per output row, one fp32 scale
 * each), K and r zero-padded to multiples of 32 (kp, rp). For each draft row m:
 *   u = w8a8(x[m] with kp - K zeros)     fp32 [r], then rp - r zeros
 *   d = w8a8(u)                          fp32 [N]
 *   out[m] = bf16((float) out[m] + d)
 * w8a8 quantizes its input per block of 32 and sums integers exactly, so every step is one fixed
 * sequence per output whatever the rows are. Against the fp32 tables it replaced: a quarter of the
 * bytes and integer dot products (VNNI: 64 multiply-adds an instruction, fp32's mul + add 8). In the
 * one-call block it rides on the projection it follows (`w4a8_linear_lora`): x's quantization is
 * shared, and each output tile gets its delta in the matmul's own pass and thread team (210 calls
 * with a team each had cost as much as the arithmetic). `benchmarks/lora_cost.py` measures it. */
#ifndef SELFSPEC_LORA8_H
#define SELFSPEC_LORA8_H
#include "w4a8_loops.h"

#define LORA_MODS 8  /* modules sharing one x: q k v, or gate up; 8 leaves room */

typedef struct lora_plan {
    int nm, aligned;  /* aligned: every module's columns start on a 16-column tile */
    int64_t n, K, groups, ntiles;
    const void *const *t;
    const int64_t *ranks, *widths, *orows;
    int64_t uoff[LORA_MODS], toff[LORA_MODS + 1], coff[LORA_MODS];
    const int8_t *xq;
    const float *dx;
    const int32_t *sx;
    float *u, *du;
    int32_t *su;
    int8_t *uq;
} lora_plan_t;

static __thread uint8_t *lora_buf = NULL;
static __thread size_t lora_cap = 0;

/* The plan of one call (x quantized with sx, K % 32 == 0; tables t[4 m ..] = A packed, A's scales,
 * B packed, B's scales, t[4 m] NULL: no LoRA on module m; module m's output columns start at the sum
 * of the widths before it): offsets, this thread's scratch, the draft rows of xq gathered where
 * they are not one run (xrows NULL: row i). Nonzero when scratch cannot be had. */
static int lora_plan(lora_plan_t *p, const int8_t *xq, const float *dx, const int32_t *sx, int64_t K, int nm,
                     const void *const *t, const int64_t *ranks, const int64_t *widths, const int64_t *xrows,
                     const int64_t *orows, int64_t n) {
    if (nm > LORA_MODS) return 1;
    int64_t nb = K / BLOCK, ucols = 0, cols = 0;
    p->nm = nm, p->n = n, p->K = K, p->t = t, p->ranks = ranks, p->widths = widths, p->orows = orows;
    p->ntiles = 0, p->aligned = 1, p->groups = (n + MAX_ROWS - 1) / MAX_ROWS;
    for (int m = 0; m < nm; m++) {
        p->uoff[m] = ucols, p->toff[m] = p->ntiles, p->coff[m] = cols;
        if (t[4 * m]) {
            ucols += (ranks[m] + BLOCK - 1) / BLOCK * BLOCK;
            p->ntiles += (widths[m] + TILE - 1) / TILE;
            p->aligned &= cols % TILE == 0;
        }
        cols += widths[m];
    }
    p->toff[nm] = p->ntiles;
    int run = 1;  /* rows in one run need no copy: tile_rows8 reads rows K apart */
    for (int64_t i = 0; i < n && xrows; i++) run &= xrows[i] == xrows[0] + i;
    size_t need = (size_t)n * (size_t)(5 * ucols + 8 * (ucols / BLOCK)) + 64 + (run ? 0 : (size_t)n * (size_t)(K + 8 * nb));
    if (need > lora_cap) {
        uint8_t *b = (uint8_t *)realloc(lora_buf, need);
        if (!b) return 1;
        lora_buf = b;
        lora_cap = need;
    }
    p->u = (float *)lora_buf, p->du = p->u + n * ucols;
    p->su = (int32_t *)(p->du + n * (ucols / BLOCK));
    p->uq = (int8_t *)(p->su + n * (ucols / BLOCK));
    int64_t x0 = xrows ? xrows[0] : 0;
    p->xq = xq + x0 * K, p->dx = dx + x0 * nb, p->sx = sx + x0 * nb;
    if (!run) {
        float *d2 = (float *)(p->uq + n * ucols);
        int32_t *s2 = (int32_t *)(d2 + n * nb);
        int8_t *x2 = (int8_t *)(s2 + n * nb);
        for (int64_t i = 0; i < n; i++) {
            memcpy(x2 + i * K, xq + xrows[i] * K, (size_t)K);
            memcpy(d2 + i * nb, dx + xrows[i] * nb, (size_t)nb * sizeof(float));
            memcpy(s2 + i * nb, sx + xrows[i] * nb, (size_t)nb * sizeof(int32_t));
        }
        p->xq = x2, p->dx = d2, p->sx = s2;
    }
    return 0;
}

/* Inside a thread team: every module's u = A x, a group of rows an item, each row quantized when
 * its sums are in (ends with the loop's barrier: the output tiles read every u) */
static void lora_u_items(const lora_plan_t *p) {
    #pragma omp for schedule(static)
    for (int64_t it = 0; it < p->nm * p->groups; it++) {
        int m = (int)(it / p->groups);
        if (!p->t[4 * m]) continue;
        int64_t r0 = (it % p->groups) * MAX_ROWS, r = p->ranks[m], rp = (r + BLOCK - 1) / BLOCK * BLOCK;
        int64_t nb = p->K / BLOCK, K = p->K, o = p->n * p->uoff[m];  /* module m's u [n, rp] starts at o */
        int R = (int)(p->n - r0 < MAX_ROWS ? p->n - r0 : MAX_ROWS);
        float *u = p->u + o;
        const float *sa = (const float *)p->t[4 * m + 1];
        memset(u + r0 * rp, 0, (size_t)(R * rp) * sizeof(float));
        for (int64_t tt = 0; tt < (r + TILE - 1) / TILE; tt++) {
            const uint8_t *w = (const uint8_t *)p->t[4 * m] + tt * nb * TILE_BYTES8;
            const int8_t *xr = p->xq + r0 * K;
            const float *dr = p->dx + r0 * nb;
            const int32_t *sr = p->sx + r0 * nb;
            int cols = (int)(r - tt * TILE < TILE ? r - tt * TILE : TILE);
            float acc[MAX_ROWS * TILE];
            ROWS_SWITCH(R, tile_rows8, sr);
            for (int i = 0; i < R; i++)
                for (int j = 0; j < cols; j++) u[(r0 + i) * rp + tt * TILE + j] = acc[i * TILE + j] * sa[tt * TILE + j];
        }
        for (int i = 0; i < R; i++) quantize_row(u, 0, r0 + i, rp, p->uq + o, p->du + o / BLOCK, NULL, p->su + o / BLOCK);
    }
}

#ifdef W4A8_VNNI
#define LORA_HALF 1  /* tile_rows8_half (w4a8_avx512.h) is at hand */
#else
#define LORA_HALF 0
#endif

/* LoRA tile `it` (0 .. ntiles - 1, module by module) added into out (bf16, rows ldo apart) */
static void lora_add_tile(const lora_plan_t *p, int64_t it, uint16_t *out, int64_t ldo) {
    int m = 0;
    while (it >= p->toff[m + 1]) m++;
    int64_t tt = it - p->toff[m], rp = (p->ranks[m] + BLOCK - 1) / BLOCK * BLOCK, nb = rp / BLOCK, K = rp;
    int64_t o = p->n * p->uoff[m];
    const uint8_t *w = (const uint8_t *)p->t[4 * m + 2] + tt * nb * TILE_BYTES8;
    const float *sb = (const float *)p->t[4 * m + 3] + tt * TILE;
    int c = (int)(p->widths[m] - tt * TILE < TILE ? p->widths[m] - tt * TILE : TILE);
    float acc[MAX_ROWS * TILE];
    for (int64_t r0 = 0; r0 < p->n; r0 += MAX_ROWS) {
        int R = (int)(p->n - r0 < MAX_ROWS ? p->n - r0 : MAX_ROWS);
        const int8_t *xr = p->uq + o + r0 * rp;
        const float *dr = p->du + o / BLOCK + r0 * nb;
        const int32_t *sr = p->su + o / BLOCK + r0 * nb;
        if (LORA_HALF && rp == BLOCK && p->ranks[m] <= TILE) {
#if LORA_HALF
            ROWS_SWITCH(R, tile_rows8_half, sr);
#endif
        } else {
            ROWS_SWITCH(R, tile_rows8, sr);
        }
        for (int i = 0; i < R; i++) {
            uint16_t *y = out + p->orows[r0 + i] * ldo + p->coff[m] + tt * TILE;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            if (c == TILE) {  /* the loop below, 16 lanes wide */
                __m512 v = _mm512_add_ps(bf16_to_ps_z(y), _mm512_mul_ps(_mm512_loadu_ps(acc + i * TILE), _mm512_loadu_ps(sb)));
                _mm256_storeu_si256((__m256i *)y, ps_to_bf16_z(v));
                continue;
            }
#endif
            for (int j = 0; j < c; j++) y[j] = float_to_bf16(bf16_to_float(y[j]) + acc[i * TILE + j] * sb[j]);
        }
    }
}

/* The matmul's output tile t (columns 16 t ..) of out (rows N apart) plus its LoRA delta, where
 * the modules are tile-aligned (the matmul calls this right after writing the tile) */
static void lora_tile(const lora_plan_t *p, int64_t t, uint16_t *out, int64_t N) {
    for (int m = 0; m < p->nm && p->aligned; m++) {
        if (p->t[4 * m] && p->coff[m] <= t * TILE && t * TILE < p->coff[m] + p->widths[m]) {
            lora_add_tile(p, p->toff[m] + t - p->coff[m] / TILE, out, N);
            return;
        }
    }
}

/* after the matmul's tiles where the modules are not tile-aligned (every thread of the team calls
 * it: the barrier waits for the whole output before any delta) */
static void lora_rest(const lora_plan_t *p, uint16_t *out, int64_t N) {
    if (p->aligned) return;
    #pragma omp barrier
    #pragma omp for schedule(static) nowait
    for (int64_t it = 0; it < p->ntiles; it++) lora_add_tile(p, it, out, N);
}
#endif
