/* Choosing tokens from a round's logits: the greedy argmax, and for sampled rows the Gumbel
 * candidates (the few tokens that may win `drafting.sampling.gumbel_argmax`'s draw) and a
 * position's uniforms. Its own unit (`build.load("sample")`), called by `kernels/layer.py`'s
 * argmax, gumbel_candidates and uniforms; torch twins in `layer.py` and `drafting/sampling.py`. */
#include "common.h"

/* argmax: y[r] = the first index of the largest value of row r of x [M, V] (bf16), the `banned`
 * index counting as -inf (-1: none) and -0 equal to +0, as torch.argmax over the float32 row with
 * x[banned] = -inf gives it; -1 where a row holds a NaN (torch puts NaN above everything: the
 * caller asks torch), and returns how many rows do. Values compare as integers, which the loops
 * vectorise: k(b) = +-(b & 0x7fff) by the sign bit orders bf16 numbers as their values (no NaN). */
static inline int32_t bf16_key(uint16_t b) { return (b & 0x8000) ? -(int32_t)(b & 0x7fff) : (int32_t)(b & 0x7fff); }
#define KEY_NEG_INF (-0x7f80)
#define ARGMAX_BLOCK 64

static int32_t key_max(const uint16_t *x, int64_t a, int64_t b, int32_t m, int *nan) {
    int nn = 0;
    for (int64_t i = a; i < b; i++) {
        int32_t k = bf16_key(x[i]);
        m = k > m ? k : m;
        nn |= (x[i] & 0x7fff) > 0x7f80;
    }
    *nan |= nn;
    return m;
}

/* the largest key of row[a, b) and its first index, `banned` counting as -inf (a part that holds
 * only the banned index answers it with -inf; an empty one answers -1) */
static int64_t argmax_part(const uint16_t *row, int64_t a, int64_t b, int64_t banned, int32_t *key, int *nan) {
    int32_t m = KEY_NEG_INF;
    if (banned >= a && banned < b) {
        m = key_max(row, a, banned, m, nan);
        m = key_max(row, banned + 1, b, m, nan);
    } else {
        m = key_max(row, a, b, m, nan);
    }
    *key = m;
    for (int64_t b0 = a; b0 < b; b0 += ARGMAX_BLOCK) {
        int64_t b1 = b0 + ARGMAX_BLOCK < b ? b0 + ARGMAX_BLOCK : b;
        int hit = 0;
        for (int64_t i = b0; i < b1; i++) hit |= bf16_key(row[i]) == m;
        hit |= banned >= b0 && banned < b1 && m == KEY_NEG_INF;
        if (!hit) continue;
        for (int64_t i = b0; i < b1; i++) if ((i == banned ? KEY_NEG_INF : bf16_key(row[i])) == m) return i;
    }
    return -1;
}

/* Rows are shared out over the threads, and a lone row is cut in two halves (the head wrote each
 * half's columns on one thread: each reads what its own cache holds). A row's answer is its
 * halves' larger key, the first half's on a tie: the same index whatever the threads. */
int64_t sample_argmax_bf16(const uint16_t *x, int64_t M, int64_t V, int64_t banned, int64_t *y, int64_t threads) {
    int64_t S = M == 1 && threads > 1 ? 2 : 1, P = M * S, nans = 0;
    int32_t keys[2];
    int64_t found[2];
    int bad[2] = {0, 0};
    #pragma omp parallel for schedule(static) num_threads(threads) if (P > 1) reduction(+ : nans)
    for (int64_t p = 0; p < P; p++) {
        int64_t r = p / S, h = p % S, a = V * h / S, b = V * (h + 1) / S;
        int nan = 0;
        int32_t key;
        int64_t i = argmax_part(x + r * V, a, b, banned, &key, &nan);
        if (S == 1) {
            y[r] = nan ? -1 : i < 0 ? 0 : i;  /* all -inf: index 0, torch's answer */
            nans += nan;
        } else {
            keys[h] = key;
            found[h] = i;
            bad[h] = nan;
        }
    }
    if (S == 2) {
        if (bad[0] | bad[1]) { y[0] = -1; return 1; }
        int second = found[1] >= 0 && (found[0] < 0 || keys[1] > keys[0]);
        y[0] = second ? found[1] : found[0] < 0 ? 0 : found[0];
    }
    return nans;
}

/* gumbel_candidates: for each row r of logits x [M, V] (float32, or bf16 when x_bf16; tempered and
 * filtered, -inf for what may not be drawn, and read as -inf at `banned` when it is >= 0), with its
 * position's uniforms u + rows[r] * V (or seeded), the tokens that may win argmax(x + gumbel(u)):
 * with lb = x[j] + g(u[j]) at the row's first largest x[j], every k with x[k] + g(u[k]) >= lb, found
 * in the blocks whose largest logit reaches lb with the position's largest noise t and then with the
 * block's own (`cand_row`). Every log here is libm's and every
 * test has a margin: bounds, not the values (torch's logs may differ from libm's in the last bit).
 * Writes (row, token) pairs to cr / cc (capacity M x per_row) in index order with each pair's logit
 * and uniform, and returns how many; -1 when a row holds a NaN or more than per_row candidates (a
 * flat distribution: the full computation is then cheaper; the caller takes it). The exact values
 * of the candidates are the caller's, in torch (`drafting.sampling.gumbel_argmax`). */
#define CAND_BLOCK 64
static inline uint64_t splitmix53(uint64_t seed, int64_t i) {  /* the 53 bits of uniform i */
    uint64_t z = seed + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return z >> 11;
}

static inline double uniform_at(uint64_t seed, int64_t i) {  /* sample_uniforms' element i */
    return ((double)splitmix53(seed, i) + 0.5) * 0x1p-53;
}

/* The largest uniform of each block of CAND_BLOCK of a position's V (ub [nb]) and of them all (the
 * return value), none of the uniforms stored (393 KB at V = 49,152): from its seed, or read from its
 * row u. The uniforms grow with z >> 11 (a 53-bit integer, converted exactly), so a block's largest
 * integer is taken and converted once: the same number as its largest uniform. */
static double block_umax(uint64_t seed, const double *u, int64_t V, double *ub) {
    double top = 0.0;
    for (int64_t b0 = 0, b = 0; b0 < V; b0 += CAND_BLOCK, b++) {
        int64_t b1 = b0 + CAND_BLOCK < V ? b0 + CAND_BLOCK : V;
        double m = 0.0;
        if (u) {
            #pragma omp simd reduction(max:m)  /* a maximum: the same in any order */
            for (int64_t i = b0; i < b1; i++) m = u[i] > m ? u[i] : m;
        } else {
            uint64_t zm = 0;
            #pragma omp simd reduction(max:zm)
            for (int64_t i = b0; i < b1; i++) {
                uint64_t z = splitmix53(seed, i);
                zm = z > zm ? z : zm;
            }
            m = ((double)zm + 0.5) * 0x1p-53;
        }
        ub[b] = m;
        top = m > top ? m : top;
    }
    return top;
}

/* Logit k of a row: float32 (xf) or bf16 (xh) as torch's .float() reads it, -inf at `banned` (the
 * token never drawn; -1: none): what `drafting.sampling.ban_token` makes, without its copy. */
static inline float logit_at(const float *xf, const uint16_t *xh, int64_t banned, int64_t k) {
    float v = xf ? xf[k] : bf16_to_float(xh[k]);
    return k == banned ? -INFINITY : v;
}

/* Whether a logit x with noise g (libm's) may reach lb: the same test with a margin far above the
 * rounding that separates libm's log from torch's (the values the caller compares), -inf never. */
static inline int reaches(double x, double g, double lb) {
    if (x == -INFINITY) return lb == -INFINITY;
    return x + g + 1e-9 * (1.0 + fabs(x) + fabs(g)) >= lb;
}

/* One row's candidates into cr / cc (capacity per_row): how many, -1 for a NaN, -2 for one too many.
 * The first pass keeps each block's largest value (bm), so that the first largest and the blocks that
 * may hold a candidate are found without reading the row again: a row is ~192 KB, its blocks' maxima 3.
 * A block is read when its largest logit reaches lb with the position's largest noise t, then with
 * its own largest noise (ub: its largest uniform), and a token of it is a candidate when it reaches lb
 * with its own noise: the few that may win (at T = 1 ~0.1 of those the first test alone lets pass,
 * which were ~140 a row, thousands in a flat one). */
static int64_t cand_row(const float *xf, const uint16_t *xh, int64_t banned, int64_t V, const double *u,
                        uint64_t seed, double t, const double *ub, int64_t r, int64_t per_row,
                        int64_t *cr, int64_t *cc, double *cx, double *cu, float *bm) {
    int64_t nb = (V + CAND_BLOCK - 1) / CAND_BLOCK;
    float best = -INFINITY;
    int nan = 0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t b0 = b * CAND_BLOCK, b1 = b0 + CAND_BLOCK < V ? b0 + CAND_BLOCK : V;
        float m = -INFINITY;
        int bnan = 0;
        if (banned >= b0 && banned < b1) {  /* its block without it, element by element: an `omp simd`
            * loop choosing per element (dtype, banned) read every row as holding a NaN at -O3 */
            for (int64_t k = b0; k < b1; k++) {
                float v = logit_at(xf, xh, banned, k);
                bnan |= v != v;
                m = v > m ? v : m;
            }
        } else if (xf) {
            #pragma omp simd reduction(max:m) reduction(|:bnan)
            for (int64_t k = b0; k < b1; k++) {
                float v = xf[k];
                bnan |= v != v;
                m = v > m ? v : m;
            }
        } else {
            #pragma omp simd reduction(max:m) reduction(|:bnan)
            for (int64_t k = b0; k < b1; k++) {
                float v = bf16_to_float(xh[k]);
                bnan |= v != v;
                m = v > m ? v : m;
            }
        }
        nan |= bnan;
        bm[b] = m;
        best = m > best ? m : best;
    }
    if (nan) return -1;
    int64_t j = 0;
    for (int64_t b = 0; b < nb; b++) {  /* the first block holding the largest, then its first index */
        if (bm[b] != best) continue;
        for (j = b * CAND_BLOCK; logit_at(xf, xh, banned, j) != best; j++) {}
        break;
    }
    double uj = u ? u[j] : uniform_at(seed, j);
    double lb = (double)best - log(-log(uj));
    lb -= 1e-9 * (1.0 + fabs(lb));
    double thr = lb - t - 1e-9 * (1.0 + fabs(lb) + fabs(t));
    if (!(thr == thr)) thr = -INFINITY;  /* -inf - (-inf) (a row of one finite token and u = 0) */
    int64_t n = 0;
    for (int64_t b = 0; b < nb; b++) {  /* blocks with no candidate (most): their maxima say so */
        if (!((double)bm[b] >= thr) || !reaches((double)bm[b], -log(-log(ub[b])), lb)) continue;
        int64_t b0 = b * CAND_BLOCK, b1 = b0 + CAND_BLOCK < V ? b0 + CAND_BLOCK : V;
        for (int64_t k = b0; k < b1; k++) {
            double xk = (double)logit_at(xf, xh, banned, k);
            if (!(xk >= thr)) continue;
            double uk = u ? u[k] : uniform_at(seed, k);
            if (!reaches(xk, -log(-log(uk)), lb)) continue;
            if (n == per_row) return -2;  /* one candidate too many: the row declines */
            cr[n] = r; cc[n] = k;
            cx[n] = xk;  /* the pair's logit and uniform, what its noisy value is made of */
            cu[n] = uk;
            n++;
        }
    }
    return n;
}

/* u NULL: position p's uniforms are those sample_uniforms makes from seeds[p], each made where read */
/* flat not NULL: a row that would decline gets flat[r] = 1 and no pairs, the others theirs (else 0) */
/* cx / cu (capacity as cr's): each pair's logit as a double and its uniform.
 * Rows share out over `threads` (each writes its own part of the outputs, packed in row order after):
 * every row's pairs are its own computation, so the result does not depend on the threads. */
int64_t sample_gumbel_candidates(const void *x, int x_bf16, int64_t banned, int64_t M, int64_t V, const double *u,
                                const uint64_t *seeds, const int64_t *rows, int64_t P, int64_t per_row, int64_t *cr,
                                int64_t *cc, double *cx, double *cu, int8_t *flat, int threads) {
    int64_t nb = (V + CAND_BLOCK - 1) / CAND_BLOCK;
    float *bm = (float *)malloc((size_t)(M * nb) * sizeof(float));
    int64_t *got = (int64_t *)malloc((size_t)M * sizeof(int64_t));
    double *top = (double *)malloc((size_t)P * sizeof(double));
    double *ub = (double *)malloc((size_t)(P * nb) * sizeof(double));
    if (!bm || !got || !top || !ub) {
        free(bm);
        free(got);
        free(top);
        free(ub);
        return -1;
    }
    #pragma omp parallel for schedule(static) num_threads(threads) if (P > 1 && threads > 1)
    for (int64_t p = 0; p < P; p++)  /* each position's largest noise, of all and of each block */
        top[p] = -log(-log(block_umax(seeds ? seeds[p] : 0, u ? u + p * V : NULL, V, ub + p * nb)));
    #pragma omp parallel for schedule(static) num_threads(threads) if (M > 1 && threads > 1)
    for (int64_t r = 0; r < M; r++)
        got[r] = cand_row(x_bf16 ? NULL : (const float *)x + r * V, x_bf16 ? (const uint16_t *)x + r * V : NULL, banned,
                          V, u ? u + rows[r] * V : NULL, seeds ? seeds[rows[r]] : 0, top[rows[r]], ub + rows[r] * nb, r, per_row, cr + r * per_row, cc + r * per_row,
                          cx + r * per_row, cu + r * per_row, bm + r * nb);
    int64_t n = 0;
    for (int64_t r = 0; r < M; r++) {
        if (flat) flat[r] = got[r] < 0;
        if (got[r] < 0) {
            if (!flat) { n = -1; break; }
            continue;
        }
        if (n != r * per_row) {
            memmove(cr + n, cr + r * per_row, (size_t)got[r] * sizeof(int64_t));
            memmove(cc + n, cc + r * per_row, (size_t)got[r] * sizeof(int64_t));
            memmove(cx + n, cx + r * per_row, (size_t)got[r] * sizeof(double));
            memmove(cu + n, cu + r * per_row, (size_t)got[r] * sizeof(double));
        }
        n += got[r];
    }
    free(bm);
    free(got);
    free(top);
    free(ub);
    return n;
}

/* uniforms: u[i] = ((z_i >> 11) + 0.5) * 2^-53 in (0, 1) for i < V, z_i = splitmix64(seed + (i + 1) *
 * 0x9E3779B97F4A7C15): a position's uniforms (`drafting.sampling.splitmix_uniforms` is the same in
 * torch ops, the bits the tests compare). Every element alone, so the loop vectorises. */
void sample_uniforms(uint64_t seed, int64_t V, double *u) {
    #pragma omp simd
    for (int64_t i = 0; i < V; i++) u[i] = uniform_at(seed, i);
}
