/* w8a8 (the output head: int8 weights with one fp32 scale per output, times w4a8's quantized
 * activations; the layout and numerics are in w4a8.c's opening comment), included at the end of
 * w4a8.c; the build key reads this header too. */
#ifndef SELFSPEC_W8A8_H
#define SELFSPEC_W8A8_H

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) void tile_rows8(
        const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *sx, int64_t K, int R,
        float *acc_out) {
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES8) {
        for (int l = 0; l < TILE_BYTES8; l += 64) _mm_prefetch((const char *)(w + PREFETCH8_Z + l), _MM_HINT_T0);
        __m512i i0[MAX_ROWS], i1[MAX_ROWS];
        for (int r = 0; r < R; r++) { i0[r] = _mm512_setzero_si512(); i1[r] = _mm512_setzero_si512(); }
        for (int ch = 0; ch < 8; ch += 2) {
            __m512i w0 = _mm512_loadu_si512((const void *)(w + 64 * ch));
            __m512i w1 = _mm512_loadu_si512((const void *)(w + 64 * ch + 64));
            for (int r = 0; r < R; r++) {
                const unaligned_i32 *xr = (const unaligned_i32 *)(xq + r * K + b * BLOCK + 4 * ch);
                DPBUSD_BCAST(i0[r], w0, xr[0]);
                DPBUSD_BCAST(i1[r], w1, xr[1]);
            }
        }
        for (int r = 0; r < R; r++) {
            __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(i0[r], i1[r]), _mm512_set1_epi32(128 * sx[r * nb + b]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d[r * nb + b])));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc_out + 16 * r, acc[r]);
}
#elif defined(__AVX2__) && defined(__F16C__)
/* Signed weights (the stored byte xor 0x80 = weight) through vpmaddubsw as |w| times x with w's
 * sign (at most 2 * 128 * 127 = 32,512 per pair: no saturation), pairs into int32 by vpmaddwd:
 * sum w x, the integer the VNNI path gets as sum (w + 128) x - 128 sum x. */
static inline __attribute__((always_inline)) void tile_rows8(
        const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *sx, int64_t K, int R,
        float *acc_out) {
    (void)sx;
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES8) {
        for (int l = 0; l < TILE_BYTES8; l += 64) _mm_prefetch((const char *)(w + PREFETCH8 + l), _MM_HINT_T0);
        __m256i i32[MAX_ROWS][2];
        for (int r = 0; r < R; r++) i32[r][0] = i32[r][1] = _mm256_setzero_si256();
        for (int ch = 0; ch < 8; ch++) {
            __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * ch)), flip);
            __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * ch + 32)), flip);
            __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
            for (int r = 0; r < R; r++) {
                const unaligned_i32 *xr = (const unaligned_i32 *)(xq + r * K + b * BLOCK + 4 * ch);
                __m256i x = _mm256_set1_epi32(xr[0]);
                i32[r][0] = _mm256_add_epi32(i32[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones));
                i32[r][1] = _mm256_add_epi32(i32[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1)), ones));
                if (R > 2) { PIN(i32[r][0]); PIN(i32[r][1]); }
            }
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(_mm256_cvtepi32_ps(i32[r][h]), _mm256_set1_ps(d[r * nb + b])));
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc_out + 16 * r, acc[r][0]);
        _mm256_storeu_ps(acc_out + 16 * r + 8, acc[r][1]);
    }
}
#else
static inline void tile_rows8(const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *sx,
                              int64_t K, int R, float *acc_out) {
    float acc[MAX_ROWS][TILE];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES8) {
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + r * K + b * BLOCK;
            for (int j = 0; j < TILE; j++) {
                int32_t s = 0;
                for (int ch = 0; ch < 8; ch++)
                    for (int i = 0; i < 4; i++) s += ((int32_t)w[64 * ch + 4 * j + i] - 128) * xr[4 * ch + i];
                acc[r][j] = acc[r][j] + (float)s * d[r * nb + b];
            }
        }
    }
    for (int r = 0; r < R; r++) memcpy(acc_out + 16 * r, acc[r], sizeof acc[r]);
}
#endif

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
#endif
