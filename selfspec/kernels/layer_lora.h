/* The draft LoRA's kernel (included by layer.c after its AVX2 helpers; the build key reads this
 * header too). */
#ifndef SELFSPEC_LAYER_LORA_H
#define SELFSPEC_LAYER_LORA_H

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
#endif
