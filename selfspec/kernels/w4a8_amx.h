/* w4a8 and w8a8 with Intel AMX tiles, where the CPU has them (w4a8.c picks them by row count).
 *
 * The same numbers as the vector loops, bit for bit: a tile multiply (TDPBSUD) sums a block's 32
 * products of signed activation bytes and unsigned weight bytes into an exact int32, as VNNI's
 * four-byte dot products do, and the float steps after it are the vector loops' own sequence per
 * output element. Only how the integers are found changes, so the rows a call has (and so which
 * path runs) move no bit.
 *
 * Per tile of 16 outputs and block of 32 inputs, for up to 16 rows at once:
 *   A = the rows' 32 quantized inputs of the block (straight from xq, one tile row a row),
 *   B = the block's weights as 8 rows of 64 bytes, row k holding inputs 4k..4k+3 of each output
 *       (the packed layout's chunks: w4a8's low and high nibbles of chunk c are rows 2c and 2c+1;
 *       w8a8's chunk c is row c as stored),
 *   C = A . B, [rows, 16] int32: each (row, output) block sum, which the float steps then scale.
 * One tile multiply stands for 16 x 16 VNNI instructions' products; the float steps are what
 * is left of the vector loops' work. Blocks alternate between two C tiles so that the next
 * block's multiply runs while this one's sums are scaled. */
#ifndef SELFSPEC_W4A8_AMX_H
#define SELFSPEC_W4A8_AMX_H
#include "w4a8.h"
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W4A8_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* rows from which a call multiplies with tiles; below, the vector loops. Each block's sums still
 * take the float steps per row after the tile multiply, and w4a8's nibbles must be unpacked to
 * bytes for B first, so tiles pay only where the rows are many; the w8a8 head, whose B is its
 * packed bytes as they are, gains from fewer rows, up to a point where its float steps dominate
 * (`benchmarks/w4a8_ab.py` measures both; docs/results.md has the figures) */
#define AMX_MIN4 32
#define AMX_MIN8 8
#define AMX_MAX8 64
#define AMX_GROUP_MIN 4  /* within such a call, a last group of fewer rows takes the vector loops */
#define AMX_ROWS 16

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* -1: not asked yet; 0: vector loops only; 1: tiles from AMX_MIN4 / AMX_MIN8 rows */
static int amx_state = -1;

/* Linux gives a process the tile registers' state only when asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a kernel or VM that refuses leaves the vector loops. */
static int amx_permitted(void) {
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* want 1: tiles where they are permitted, 0: vector loops only, -1: as is. Returns the state. */
int w4a8_amx(int want) {
    if (want == 0) amx_state = 0;
    else if (want == 1 || amx_state < 0) amx_state = amx_permitted();
    return amx_state;
}

/* tmm0/tmm4: A (R rows x 32 bytes), tmm1/tmm5: B (8 x 64), tmm2/tmm3: C (R x 64) */
static inline void amx_configure(int R) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[4] = (uint8_t)R; cfg.colsb[0] = cfg.colsb[4] = 32;
    cfg.rows[1] = cfg.rows[5] = 8; cfg.colsb[1] = cfg.colsb[5] = 64;
    cfg.rows[2] = cfg.rows[3] = (uint8_t)R; cfg.colsb[2] = cfg.colsb[3] = 64;
    _tile_loadconfig(&cfg);
}

/* w4a8: a tile's nb blocks of nibbles [nb][320] as bytes [nb][8][64], B's rows. All of them before
 * any tile load: a tile load waits for the stores it reads to reach the cache (none forward to it),
 * which block by block stalled every one */
static inline void amx_unpack4(const uint8_t *w, int64_t nb, uint8_t *ub) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++, w += TILE_BYTES, ub += 512) {
        for (int l = 0; l < TILE_BYTES; l += 64) _mm_prefetch((const char *)(w + PREFETCH_Z + l), _MM_HINT_T0);
        for (int ch = 0; ch < 4; ch++) {
            __m512i raw = _mm512_loadu_si512((const void *)(w + 64 * ch));
            _mm512_store_si512((void *)(ub + 128 * ch), _mm512_and_si512(raw, low));
            _mm512_store_si512((void *)(ub + 128 * ch + 64), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
        }
    }
}

/* this thread's buffer for a tile's unpacked blocks (amx_unpack4), grown as needed and kept; NULL
 * when memory runs out (the vector loops then run) */
static __thread uint8_t *amx_buf = NULL;
static __thread int64_t amx_cap = 0;
static uint8_t *amx_unpacked(int64_t nb) {
    if (nb * 512 > amx_cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, (size_t)nb * 512)) return NULL;
        free(amx_buf);
        amx_buf = (uint8_t *)p;
        amx_cap = nb * 512;
    }
    return amx_buf;
}

/* one block's products into C tile TC from A tile TA (rows' inputs at x, stride K) and B tile TB (at bw) */
#define AMX_DOT(TC, TA, TB, bw, x, K) do { \
    _tile_loadd(TB, (bw), 64); _tile_loadd(TA, (x), (K)); _tile_zero(TC); _tile_dpbsud(TC, TA, TB); } while (0)

/* w4a8: acc_out [R][16] as tile_rows leaves it, R <= 16; ub: the tile's blocks unpacked (amx_unpack4),
 * w: as packed (the scales and minimums) */
static inline __attribute__((always_inline)) void amx_rows4(
        const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const float *c, int64_t K, int R,
        float *acc_out, const uint8_t *ub) {
    __m512 acc[AMX_ROWS];
    __attribute__((aligned(64))) int32_t cb[2][AMX_ROWS * 16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    AMX_DOT(2, 0, 1, ub, xq, K);
    for (int64_t b = 0; b <= nb; b++) {
        /* block b + 1's multiply into the other C tile, block b's sums out, then block b - 1's
         * (stored an iteration ago: loads do not wait for a tile store still under way) scaled */
        if (b < nb) {
            if (b % 2 == 0) {
                if (b + 1 < nb) AMX_DOT(3, 4, 5, ub + (b + 1) * 512, xq + (b + 1) * BLOCK, K);
                _tile_stored(2, cb[0], 64);
            } else {
                if (b + 1 < nb) AMX_DOT(2, 0, 1, ub + (b + 1) * 512, xq + (b + 1) * BLOCK, K);
                _tile_stored(3, cb[1], 64);
            }
        }
        if (b == 0) continue;
        int64_t p = b - 1;
        const uint8_t *wb = w + p * TILE_BYTES;
        const int32_t *cp = cb[p % 2];
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 256)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + 288)));
        for (int r = 0; r < R; r++) {
            __m512i isum = _mm512_load_si512((const void *)(cp + 16 * r));
            __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), s), _mm512_set1_ps(d[r * nb + p]));
            __m512 u = _mm512_mul_ps(m, _mm512_set1_ps(c[r * nb + p]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(t, u));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc_out + 16 * r, acc[r]);
}

/* w8a8: acc_out [R][16] as tile_rows8 leaves it (before the outputs' scales), R <= 16 */
static inline __attribute__((always_inline)) void amx_rows8(
        const uint8_t *w, int64_t nb, const int8_t *xq, const float *d, const int32_t *sx, int64_t K, int R,
        float *acc_out, const uint8_t *unused) {
    (void)unused;
    __m512 acc[AMX_ROWS];
    __attribute__((aligned(64))) int32_t cb[AMX_ROWS * 16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    AMX_DOT(2, 0, 1, w, xq, K);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * TILE_BYTES8;
        for (int l = 0; l < TILE_BYTES8; l += 64) _mm_prefetch((const char *)(wb + PREFETCH8_Z + l), _MM_HINT_T0);
        if (b % 2 == 0) {
            if (b + 1 < nb) AMX_DOT(3, 4, 5, wb + TILE_BYTES8, xq + (b + 1) * BLOCK, K);
            _tile_stored(2, cb, 64);
        } else {
            if (b + 1 < nb) AMX_DOT(2, 0, 1, wb + TILE_BYTES8, xq + (b + 1) * BLOCK, K);
            _tile_stored(3, cb, 64);
        }
        for (int r = 0; r < R; r++) {
            __m512i isum = _mm512_sub_epi32(_mm512_load_si512((const void *)(cb + 16 * r)),
                                            _mm512_set1_epi32(128 * sx[r * nb + b]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d[r * nb + b])));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc_out + 16 * r, acc[r]);
}

#define AMX_CASE(FN, ARG, n) case n: FN(w, nb, xr, dr, ARG, K, n, acc AMX_EXTRA); break;
/* R a constant in each case: the accumulators stay in registers */
#define AMX_SWITCH(R, FN, ARG) switch (R) { \
    AMX_CASE(FN, ARG, 16) AMX_CASE(FN, ARG, 15) AMX_CASE(FN, ARG, 14) AMX_CASE(FN, ARG, 13) \
    AMX_CASE(FN, ARG, 12) AMX_CASE(FN, ARG, 11) AMX_CASE(FN, ARG, 10) AMX_CASE(FN, ARG, 9) \
    AMX_CASE(FN, ARG, 8) AMX_CASE(FN, ARG, 7) AMX_CASE(FN, ARG, 6) AMX_CASE(FN, ARG, 5) \
    default: FN(w, nb, xr, dr, ARG, K, 4, acc AMX_EXTRA); break; }

static inline int amx_use(int64_t M, int64_t least, int64_t most) {
    if (M < least || M > most) return 0;
    if (amx_state < 0) w4a8_amx(-1);
    return amx_state == 1;
}
#endif
#endif
