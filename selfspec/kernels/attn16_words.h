/* The exact attention's weighted sums in integers, where the CPU has AVX-512 BW and VNNI. */
#ifndef SELFSPEC_ATTN16_WORDS_H
#define SELFSPEC_ATTN16_WORDS_H
#include "attn16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* The weighted sums in integers where AVX-512 VNNI is at hand: each row's weights (integers
 * 0 .. 2^20, as attn16_weights makes them) are written once as words for its pairs of keys
 * (2m, 2m + 1), the two weights' high 10-bit limbs side by side in one 32-bit word (wh) and their
 * low limbs in another (wl). A key pair then costs one instruction per limb, query and sixteen
 * dimensions, p_2m v_2m + p_2m+1 v_2m+1 summed in int32 (the two keys' values interleaved, the
 * word broadcast from memory): a quarter of the float64 tiles' instructions and none of their
 * conversions. Products are below 2^25, so a lane takes 30 pairs before it is added to a float64
 * sum; every sum is the float64 loop's exact integer, so the same bits. Where a key head's V
 * shifts differ (a real model's never did: `pv_uniform`) or a weight is no integer in 0 .. 2^20,
 * the float64 tiles run instead. */
#define PV_FLUSH 30  /* key pairs an int32 lane takes: 30 x 2 x 2^10 x 2^15 < 2^31 */
static __thread int32_t *pvw_buf = NULL;  /* the words, reused */
static __thread size_t pvw_cap = 0;

static int pv_uniform(const int8_t *vs, int64_t R, int64_t KV, int64_t S, int64_t srs, int64_t shs) {
    int diff = 0;  /* every layer of every round reads its key heads' shifts: one vector pass, no early exit */
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < KV; h++) {
            const int8_t *sh = vs + r * srs + h * shs;
            #pragma omp simd reduction(|:diff)
            for (int64_t j = 1; j < S; j++) diff |= sh[j] ^ sh[0];
        }
    return !diff;
}

/* a one-byte cache's V: every shift at most 8, so that its values widened times 2^shift (load_v32) are
 * int16 with one shift (0) for the int32 lanes */
static int pv_fits8(const int8_t *vs, int64_t R, int64_t KV, int64_t S, int64_t srs, int64_t shs) {
    int over = 0;
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < KV; h++) {
            const int8_t *sh = vs + r * srs + h * shs;
            #pragma omp simd reduction(|:over)
            for (int64_t j = 0; j < S; j++) over |= sh[j] > 8;
        }
    return !over;
}

/* one row's weights sr [S] -> its words whr, wlr [(S + 1) / 2 + 8]; nonzero where a weight is no
 * integer in 0 .. 2^20 */
static int row_words(const double *sr, int64_t S, int32_t *whr, int32_t *wlr) {
    const __m512i top = _mm512_set1_epi32(1 << 20), low = _mm512_set1_epi32(1023);
    int bad = 0;
    for (int64_t j = 0; j < S; j += 16) {  /* eight pairs: 16 weights */
        __mmask8 m0 = S - j >= 8 ? 0xFF : (S - j > 0 ? (__mmask8)((1u << (S - j)) - 1) : 0);
        __mmask8 m1 = S - j >= 16 ? 0xFF : (S - j > 8 ? (__mmask8)((1u << (S - j - 8)) - 1) : 0);
        __m512d p0 = _mm512_maskz_loadu_pd(m0, sr + j), p1 = _mm512_maskz_loadu_pd(m1, sr + j + 8);
        __m256i i0 = _mm512_cvtpd_epi32(p0), i1 = _mm512_cvtpd_epi32(p1);
        __m512i pi = _mm512_inserti64x4(_mm512_castsi256_si512(i0), i1, 1);
        bad |= _mm512_cmpgt_epu32_mask(pi, top) != 0;  /* < 0 or > 2^20 (NaN and overflow convert to < 0) */
        bad |= (_mm512_cmp_pd_mask(p0, _mm512_cvtepi32_pd(i0), _CMP_NEQ_UQ) |  /* a fraction */
                _mm512_cmp_pd_mask(p1, _mm512_cvtepi32_pd(i1), _CMP_NEQ_UQ)) != 0;
        __m512i limb[2] = {_mm512_srli_epi32(pi, 10), _mm512_and_si512(pi, low)};
        int32_t *dst[2] = {whr + j / 2, wlr + j / 2};
        for (int l = 0; l < 2; l++) {  /* (even | odd << 32) -> even | odd << 16 in each 64-bit lane */
            __m512i t = _mm512_or_si512(limb[l], _mm512_srli_epi64(limb[l], 16));
            _mm256_storeu_si256((__m256i *)dst[l], _mm512_cvtepi64_epi32(t));
        }
    }
    return bad;
}

/* weights p [n, S] -> wh, wl [n, ws] (ws >= (S + 1) / 2 + 8); 0 where one is no integer in 0 .. 2^20 */
static int weights_words(const double *p, int64_t n, int64_t S, int32_t *wh, int32_t *wl, int64_t ws, int threads) {
    int bad = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) reduction(|:bad) if (n * S * 4 >= PAR_MIN)
    for (int64_t row = 0; row < n; row++) bad |= row_words(p + row * S, S, wh + row * ws, wl + row * ws);
    return !bad;
}

/* the words' scratch (this thread's, reused), or NULL */
static int32_t *words_scratch(size_t need) {
    if (need > pvw_cap) {
        int32_t *b = (int32_t *)realloc(pvw_buf, need * sizeof(int32_t));
        if (!b) return NULL;
        pvw_buf = b;
        pvw_cap = need;
    }
    return pvw_buf;
}

/* 32 values of key j at element `at` of a V head: int16, or (kb == 1) int8 widened times 2^vsh[j] */
static inline __attribute__((always_inline)) __m512i load_v32(const void *vh, const int8_t *vsh, const int kb,
                                                              int64_t at, int64_t j) {
    if (kb == 1)
        return _mm512_sll_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)vh + at))),
                                _mm_cvtsi32_si128(vsh[j]));
    return _mm512_loadu_si512((const void *)((const int16_t *)vh + at));
}

#define PV_BLOCK 6     /* key pairs one zero test of the high limbs covers (PV_FLUSH = 5 blocks) */

/* Pairs m0 .. m1 - 1 for n <= Q queries (their words rows ws apart) and dimensions d0 .. d0 + 32 ND - 1,
 * added to acc [Q][2 limbs][D] (lane i of an interleave's half h is dimension 8 (i / 4) + 4 h + i % 4 of
 * its 32). The low limbs of every pair, then the high limbs of the blocks of PV_BLOCK pairs where one is
 * nonzero: a weight below 2^10 (most of a long context's on real text) has none,
 * and a skipped product is an exact zero, so the sums are the same integers. */
static inline __attribute__((always_inline)) void pv_chunk(const int32_t *wh, const int32_t *wl, int64_t ws, int64_t n,
                                                           const int ND, int64_t S, int64_t D, int64_t d0, int64_t m0,
                                                           int64_t m1, const void *vh, const int8_t *vsh, const int kb,
                                                           double *acc) {
    enum { Q = 3 };  /* six queries rarely leave a block without a high limb: pv_words_tile takes them */
    const int32_t *hr[Q], *lr[Q];
    for (int u = 0; u < Q; u++) {
        hr[u] = wh + (u < n ? u : 0) * ws;
        lr[u] = wl + (u < n ? u : 0) * ws;
    }
    __m512i a[Q][2][2];  /* [query][32 dims][interleave half] */
#define PV_FLUSH_INTO(l)                                                                                          \
    for (int u = 0; u < Q; u++)                                                                                   \
        for (int c = 0; c < ND; c++)                                                                              \
            for (int h = 0; h < 2; h++) {                                                                         \
                double *o = acc + (u * 2 + (l)) * D + d0 + 32 * c + 16 * h;                                       \
                if (u < n) {                                                                                      \
                    _mm512_storeu_pd(o, _mm512_add_pd(_mm512_loadu_pd(o),                                         \
                                                      _mm512_cvtepi32_pd(_mm512_castsi512_si256(a[u][c][h])))); \
                    _mm512_storeu_pd(o + 8, _mm512_add_pd(_mm512_loadu_pd(o + 8),                                \
                                                          _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a[u][c][h], 1)))); \
                }                                                                                                 \
                a[u][c][h] = _mm512_setzero_si512();                                                              \
            }
#define PV_PAIR(m, rows)                                                                                          \
    {                                                                                                             \
        int64_t ja = 2 * (m), jb = 2 * (m) + 1 < S ? ja + 1 : ja; /* a last odd key: weight 0 */                \
        for (int c = 0; c < ND; c++) {                                                                            \
            __m512i va = load_v32(vh, vsh, kb, ja * D + d0 + 32 * c, ja), vb = load_v32(vh, vsh, kb, jb * D + d0 + 32 * c, jb); \
            __m512i x0 = _mm512_unpacklo_epi16(va, vb), x1 = _mm512_unpackhi_epi16(va, vb);                       \
            for (int u = 0; u < Q; u++) {                                                                         \
                DPWSSD_BCAST(a[u][c][0], x0, rows[u][m]);                                                         \
                DPWSSD_BCAST(a[u][c][1], x1, rows[u][m]);                                                         \
            }                                                                                                     \
        }                                                                                                         \
    }
    for (int u = 0; u < Q; u++)
        for (int c = 0; c < ND; c++) a[u][c][0] = a[u][c][1] = _mm512_setzero_si512();
    for (int64_t w0 = m0; w0 < m1; w0 += PV_FLUSH) {
        int64_t w1 = w0 + PV_FLUSH < m1 ? w0 + PV_FLUSH : m1;
        for (int64_t m = w0; m < w1; m++) {
            for (int r = 0; r < 2; r++)  /* the pair 16 ahead, its two rows' 32 ND values (the second pass finds them in cache) */
                for (int l = 0; l < 32 * ND * kb; l += 64)
                    _mm_prefetch((const char *)vh + ((2 * (m + 16) + r) * D + d0) * kb + l, _MM_HINT_T0);
            PV_PAIR(m, lr)
        }
        PV_FLUSH_INTO(1)
    }
    int blocks = 0;
    for (int64_t b0 = m0; b0 < m1; b0 += PV_BLOCK) {
        int64_t b1 = b0 + PV_BLOCK < m1 ? b0 + PV_BLOCK : m1;
        __mmask8 k = (__mmask8)((1u << (b1 - b0)) - 1);
        __m256i any = _mm256_setzero_si256();
        for (int u = 0; u < Q; u++) any = _mm256_or_si256(any, _mm256_maskz_loadu_epi32(k, hr[u] + b0));
        if (_mm256_testz_si256(any, any)) continue;
        for (int64_t m = b0; m < b1; m++) PV_PAIR(m, hr)
        if (++blocks == PV_FLUSH / PV_BLOCK) {
            PV_FLUSH_INTO(0)
            blocks = 0;
        }
    }
    PV_FLUSH_INTO(0)
#undef PV_FLUSH_INTO
#undef PV_PAIR
}

/* n <= Q queries' sums over pairs m0 .. m1 - 1 and dimensions d0 .. d0 + 31, both limbs in one pass
 * (each value row read once): sums [query][limb][lane], lanes as pv_chunk's. A short context's task
 * (all its pairs: its sums are the result) and six queries' chunks (their weights rarely leave a
 * block of pairs without a high limb, and pv_chunk's second pass would read the values again). */
static inline __attribute__((always_inline)) void pv_words_tile(const int32_t *wh, const int32_t *wl, int64_t ws,
                                                                int64_t n, const int Q, int64_t S, int64_t D,
                                                                int64_t d0, int64_t m0, int64_t m1, const void *vh,
                                                                const int8_t *vsh, const int kb, double sums[6][2][32]) {
    const int32_t *hr[6], *lr[6];
    for (int u = 0; u < Q; u++) {
        hr[u] = wh + (u < n ? u : 0) * ws;
        lr[u] = wl + (u < n ? u : 0) * ws;
    }
    memset(sums, 0, 6 * 2 * 32 * sizeof(double));
    for (int64_t w0 = m0; w0 < m1; w0 += PV_FLUSH) {
        int64_t w1 = w0 + PV_FLUSH < m1 ? w0 + PV_FLUSH : m1;
        __m512i a[6][2][2];  /* [query][limb][interleave half] */
        for (int u = 0; u < Q; u++)
            for (int l = 0; l < 2; l++) a[u][l][0] = a[u][l][1] = _mm512_setzero_si512();
        for (int64_t m = w0; m < w1; m++) {
            int64_t ja = 2 * m, jb = 2 * m + 1 < S ? ja + 1 : ja;  /* a last odd key: weight 0 */
            for (int r = 0; r < 2; r++)  /* the pair 16 ahead: its two rows' 32 values */
                _mm_prefetch((const char *)vh + ((2 * (m + 16) + r) * D + d0) * kb, _MM_HINT_T0);
            __m512i va = load_v32(vh, vsh, kb, ja * D + d0, ja), vb = load_v32(vh, vsh, kb, jb * D + d0, jb);
            __m512i x0 = _mm512_unpacklo_epi16(va, vb), x1 = _mm512_unpackhi_epi16(va, vb);
            for (int u = 0; u < Q; u++) {
                DPWSSD_BCAST(a[u][0][0], x0, hr[u][m]);
                DPWSSD_BCAST(a[u][0][1], x1, hr[u][m]);
                DPWSSD_BCAST(a[u][1][0], x0, lr[u][m]);
                DPWSSD_BCAST(a[u][1][1], x1, lr[u][m]);
            }
        }
        for (int u = 0; u < Q; u++)  /* Q, not n: a constant bound keeps a[][][] in registers */
            for (int l = 0; l < 2; l++)
                for (int h = 0; h < 2; h++) {
                    double *o = sums[u][l] + 16 * h;
                    _mm512_storeu_pd(o, _mm512_add_pd(_mm512_loadu_pd(o), _mm512_cvtepi32_pd(_mm512_castsi512_si256(a[u][l][h]))));
                    _mm512_storeu_pd(o + 8, _mm512_add_pd(_mm512_loadu_pd(o + 8),
                                                          _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a[u][l][h], 1))));
                }
    }
}

/* One query row's weighted values from its partial sums ([2 limbs][D] each, nparts of them `stride`
 * doubles apart, lanes as pv_chunk leaves them): integers below 2^53, exact in any order, so the
 * same bits however the keys were split. */
static inline void pv_sum_parts(const double *parts, int64_t nparts, int64_t stride, int64_t D, double f, double *out) {
    for (int64_t d = 0; d < D; d += 32)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 16; i++) {
                double hi = 0.0, lo = 0.0;
                for (int64_t c = 0; c < nparts; c++) {
                    hi += parts[c * stride + d + 16 * h + i];
                    lo += parts[c * stride + D + d + 16 * h + i];
                }
                out[d + 8 * (i / 4) + 4 * h + i % 4] = (hi * 1024.0 + lo) * f;
            }
}

/* n <= tq queries' pairs m0 .. m1 - 1, every dimension, into acc [n][2][D]: pv_chunk (its zero
 * tests) for a group of three, pv_words_tile for six */
static inline __attribute__((always_inline)) void pv_chunks_impl(const int32_t *hr, const int32_t *lr, int64_t ws,
                                                                 int64_t n, int64_t tq, int64_t S, int64_t D, int64_t m0,
                                                                 int64_t m1, const void *vh, const int8_t *vsh,
                                                                 const int kb, double *acc) {
    if (tq == 6) {
        double sums[6][2][32];
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            pv_words_tile(hr, lr, ws, n, 6, S, D, d0, m0, m1, vh, vsh, kb, sums);
            for (int64_t u = 0; u < n; u++)
                for (int l = 0; l < 2; l++)
                    for (int i = 0; i < 32; i++) acc[(u * 2 + l) * D + d0 + i] += sums[u][l][i];
        }
        return;
    }
    for (int64_t d0 = 0; d0 < D; d0 += (D - d0) % 64 == 0 ? 64 : 32) {
        if ((D - d0) % 64 == 0) pv_chunk(hr, lr, ws, n, 2, S, D, d0, m0, m1, vh, vsh, kb, acc);
        else pv_chunk(hr, lr, ws, n, 1, S, D, d0, m0, m1, vh, vsh, kb, acc);
    }
}

static void pv_chunks_of(const int32_t *hr, const int32_t *lr, int64_t ws, int64_t n, int64_t tq, int64_t S,
                         int64_t D, int64_t m0, int64_t m1, const int16_t *vh, double *acc) {
    pv_chunks_impl(hr, lr, ws, n, tq, S, D, m0, m1, vh, NULL, 2, acc);
}

/* pv_chunks_of over a one-byte cache's V (rows v8 [S, D], shifts sh, all at most 8: pv_fits8): each
 * value widened times its 2^shift as it is loaded (load_v32), so the sums' factor is 1 */
static void pv_chunks_of8(const int32_t *hr, const int32_t *lr, int64_t ws, int64_t n, int64_t tq, int64_t S,
                          int64_t D, int64_t m0, int64_t m1, const int8_t *v8, const int8_t *sh, double *acc) {
    pv_chunks_impl(hr, lr, ws, n, tq, S, D, m0, m1, v8, sh, 1, acc);
}

/* queries a weighted-sums task takes: threes with the zero tests up to two of them (a one- or
 * two-token round), else sixes, read in one pass (a wider round's weights rarely skip a block) */
static inline int64_t pv_group(int64_t G) {
    return G <= 6 ? 3 : 6;
}

/* pv_words splits a key head's pairs into chunks until there are PV_TASKS tasks (key heads x groups of
 * 3 queries, a one-token round, or 6, x chunks), chunks of at least PV_CHUNK pairs: enough to keep
 * any thread count busy, and no more partial sums to add than that needs (a wide round has its tasks
 * in its query groups already) */
#define PV_CHUNK 240
#define PV_TASKS 16
static inline int64_t pv_chunks(int64_t R, int64_t KV, int64_t G, int64_t S) {
    int64_t tq = pv_group(G), groups = R * KV * ((G + tq - 1) / tq), most = ((S + 1) / 2 + PV_CHUNK - 1) / PV_CHUNK;
    int64_t want = (PV_TASKS + groups - 1) / groups;
    return want < most ? want : (most > 0 ? most : 1);
}

/* doubles of scratch pv_words needs for its tasks' partial sums */
static inline int64_t pv_part(int64_t R, int64_t KV, int64_t G, int64_t D, int64_t S) {
    int64_t tq = pv_group(G);
    return R * KV * ((G + tq - 1) / tq) * pv_chunks(R, KV, G, S) * tq * 2 * D;
}

/* attn16_pv's sums from the words. A task sums one chunk of a key head's pairs for its queries and every
 * dimension (each value row read once); the chunks' partial sums are integers, added in any order to the
 * same result, so the keys split over the threads however long the context (a one-token round's three
 * key heads alone would leave one thread a third of the work). part: pv_part doubles. */
static void pv_words(const int32_t *wh, const int32_t *wl, int64_t ws, int64_t R, int64_t KV, int64_t G, int64_t D,
                     const void *vc, int64_t vrs, int64_t vhs, const int8_t *vs, int64_t srs, int64_t shs, int64_t S,
                     double *out, double *part, int threads, int kb) {
    int64_t np = (S + 1) / 2;
    const int16_t *v = (const int16_t *)vc;
    if (np <= PV_CHUNK) {  /* a short context: tasks of 3 or 6 queries and 32 dimensions over every pair, no partials */
        int64_t tq = G <= 3 ? 3 : 6, ng = (G + tq - 1) / tq, nd = D / 32;
        #pragma omp parallel for schedule(static) collapse(3) num_threads(threads) if (R * KV * G * S * D >= PAR_MIN)
        for (int64_t rh = 0; rh < R * KV; rh++)
            for (int64_t qg = 0; qg < ng; qg++)
                for (int64_t db = 0; db < nd; db++) {
                    int64_t i0 = tq * qg, n = G - i0 < tq ? G - i0 : tq, row = rh * G + i0;
                    int64_t at = (rh / KV) * vrs + (rh % KV) * vhs, sat = (rh / KV) * srs + (rh % KV) * shs;
                    /* a one-byte cache's values carry their shifts as they are loaded: factor 1 */
                    double f = kb == 1 ? 1.0 : pow2(vs[sat]), sums[6][2][32];
                    if (kb == 1 && tq == 3)
                        pv_words_tile(wh + row * ws, wl + row * ws, ws, n, 3, S, D, 32 * db, 0, np,
                                      (const int8_t *)vc + at, vs + sat, 1, sums);
                    else if (kb == 1)
                        pv_words_tile(wh + row * ws, wl + row * ws, ws, n, 6, S, D, 32 * db, 0, np,
                                      (const int8_t *)vc + at, vs + sat, 1, sums);
                    else if (tq == 3)
                        pv_words_tile(wh + row * ws, wl + row * ws, ws, n, 3, S, D, 32 * db, 0, np, v + at, NULL, 2, sums);
                    else
                        pv_words_tile(wh + row * ws, wl + row * ws, ws, n, 6, S, D, 32 * db, 0, np, v + at, NULL, 2, sums);
                    for (int64_t u = 0; u < n; u++)  /* one part of 32 dimensions: the sums are the result */
                        pv_sum_parts(sums[u][0], 1, 0, 32, f, out + (row + u) * D + 32 * db);
                }
        return;
    }
    int64_t tq = pv_group(G), ng = (G + tq - 1) / tq, nc = pv_chunks(R, KV, G, S);
    int64_t tasks = R * KV * ng * nc, per = tq * 2 * D, span = ((np + nc - 1) / nc + PV_FLUSH - 1) / PV_FLUSH * PV_FLUSH;
    #pragma omp parallel for schedule(static) num_threads(threads) if (R * KV * G * S * D >= PAR_MIN)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t rh = t / (ng * nc), qg = (t / nc) % ng, ch = t % nc;
        int64_t r = rh / KV, h = rh % KV, i0 = tq * qg, n = G - i0 < tq ? G - i0 : tq, row = rh * G + i0;
        int64_t m0 = ch * span < np ? ch * span : np, m1 = m0 + span < np ? m0 + span : np;
        const int16_t *vh = v + r * vrs + h * vhs;
        double *acc = part + t * per;
        memset(acc, 0, (size_t)per * sizeof(double));
        if (kb == 1)
            pv_chunks_of8(wh + row * ws, wl + row * ws, ws, n, tq, S, D, m0, m1,
                          (const int8_t *)vc + r * vrs + h * vhs, vs + r * srs + h * shs, acc);
        else
            pv_chunks_of(wh + row * ws, wl + row * ws, ws, n, tq, S, D, m0, m1, vh, acc);
    }
    #pragma omp parallel for schedule(static) num_threads(threads) if (R * KV * G * nc * D * 64 >= PAR_MIN)
    for (int64_t row = 0; row < R * KV * G; row++) {
        int64_t rh = row / G, rq = rh * ng + (row % G) / tq, u = (row % G) % tq;
        pv_sum_parts(part + rq * nc * per + u * 2 * D, nc, per, D,
                     kb == 1 ? 1.0 : pow2(vs[(rh / KV) * srs + (rh % KV) * shs]), out + row * D);
    }
}
#endif
#endif
