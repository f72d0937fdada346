/* The target's sampled tokens (`drafting.sampling.gumbel_argmax`): the Gumbel candidates of a round's
 * rows and a position's uniforms, included by layer.c (its helpers: bf16.h, math.h, omp.h). */
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

static inline double uniform_at(uint64_t seed, int64_t i) {  /* layer_uniforms' element i */
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

/* u NULL: position p's uniforms are those layer_uniforms makes from seeds[p], each made where read */
/* flat not NULL: a row that would decline gets flat[r] = 1 and no pairs, the others theirs (else 0) */
/* cx / cu (capacity as cr's): each pair's logit as a double and its uniform.
 * Rows share out over `threads` (each writes its own part of the outputs, packed in row order after):
 * every row's pairs are its own computation, so the result does not depend on the threads. */
int64_t layer_gumbel_candidates(const void *x, int x_bf16, int64_t banned, int64_t M, int64_t V, const double *u,
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
void layer_uniforms(uint64_t seed, int64_t V, double *u) {
    #pragma omp simd
    for (int64_t i = 0; i < V; i++) u[i] = uniform_at(seed, i);
}
